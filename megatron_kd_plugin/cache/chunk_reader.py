"""Reads inner chunks of a sharded zarr v3 array, from a local disk or an object store (``storage.py``), in the
calling thread, and checks them.

Why: zarr-python 3.4 hops through its event loop and a thread pool for every ``array[i]`` (~1-3 ms per call
here, against ~0.3 ms to decode a [512, 100] chunk), which caps a per-sample reader at a few 100k tokens/s.
This reader does what the zarr v3 sharding spec says and nothing else: read the shard index at the end of the
shard file (``n_chunks × (offset, nbytes)`` little-endian uint64, then its CRC32C), read that byte range, check
the chunk's own CRC32C when the chunk codecs end with ``crc32c``, and run the inner codecs backwards with
numcodecs (zarr's own codec library). It accepts only layouts it understands (index at the end, codecs
``bytes``/``blosc``/``zstd``/``numcodecs.*`` (filters, or a serializer such as the log-prob grid,
``logprob_grid.py``), optionally ``crc32c`` last); :func:`open_chunk_reader` returns None
for anything else. Tests compare it with zarr's reads.

It reads stores in which every chunk was written (format versions 2 and 3, ``format.py``): a missing shard file,
an empty index entry, an index entry outside the file, a checksum that does not match, or a chunk that decodes to
the wrong size raises :class:`DamagedStoreError` naming the file and the samples (rows of the first axis) the
shard holds, where zarr would return the fill value for the first two. :meth:`ShardedChunkReader.read` also
returns the chunk's CRC32C, which the store's records bind to the chunk's place (``records.py``).
"""

from __future__ import annotations

import collections
import math
import threading

import google_crc32c
import numcodecs
import numpy as np
import zarr
from zarr.abc.codec import ArrayBytesCodec
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

_EMPTY = 2**64 - 1
CACHE_BYTES = 1 << 22
"""What a reader keeps of one array's shard indexes (and of the records of its shards, ``records.py``) at most, in
bytes, each entry counted with :data:`ENTRY_BYTES` of bookkeeping: its memory does not grow with the store it reads (a
shard index is 16 B per chunk: 4 KiB at the default 256 samples a shard, so ~1,000 shards' indexes; a miss costs one
read of the index)."""
ENTRY_BYTES = 256
"""What a cached entry costs beyond its values (the numpy array object and the cache's own bookkeeping)."""


class BoundedCache:
    """{key: numpy array} holding at most ``max_bytes`` (values and :data:`ENTRY_BYTES` each), the least recently
    used dropped first."""

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._values: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()                  # read-ahead threads share it (``read_ahead.py``)

    def __getstate__(self):                            # a reader pickled into a DataLoader worker: a lock of its own
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key, value: np.ndarray) -> None:
        with self._lock:
            self._pop(key)
            self._values[key] = value
            self.nbytes += value.nbytes + ENTRY_BYTES
            while self.nbytes > self.max_bytes and len(self._values) > 1:
                self.nbytes -= self._values.popitem(last=False)[1].nbytes + ENTRY_BYTES

    def pop(self, key) -> None:
        with self._lock:
            self._pop(key)

    def _pop(self, key) -> None:
        value = self._values.pop(key, None)
        if value is not None:
            self.nbytes -= value.nbytes + ENTRY_BYTES

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.nbytes = 0

    def __len__(self) -> int:
        return len(self._values)


class DamagedStoreError(ValueError):
    """A store's file does not hold what its metadata say (missing, truncated, checksum mismatch)."""


REPAIR = ("rewrite the damaged shards: rerun the cache command that wrote the store with --repair added "
          "(`python -m megatron_kd_plugin inspect STORE --verify` lists them)")
"""What every damage error tells the user to do."""


def _checked(data: bytes, what: str) -> tuple[np.ndarray, int]:
    """(``data`` without its trailing little-endian CRC32C (a uint8 view, no copy), that CRC32C), after comparing
    it with the CRC32C of the rest."""
    view = np.frombuffer(data, dtype=np.uint8)
    stored = int.from_bytes(data[-4:], "little")
    if len(view) < 4 or google_crc32c.value(view[:-4]) != stored:
        raise DamagedStoreError(f"{what}: stored and computed CRC32C checksums do not match (the file is damaged; "
                                f"{REPAIR})")
    return view[:-4], stored


def _numcodec(codec) -> numcodecs.abc.Codec:
    """The numcodecs codec behind zarr's ``numcodecs.*`` wrapper ``codec``."""
    spec = codec.to_dict()
    return numcodecs.get_codec({"id": spec["name"].removeprefix("numcodecs."), **spec.get("configuration", {})})


class ShardedChunkReader:
    """``reader.read(coords)`` -> the decoded inner chunk at chunk-grid coordinates ``coords``."""

    def __init__(self, files, folder: str, array: zarr.Array, sharding: ShardingCodec):
        self.files, self.folder, self.metadata = files, folder, array.metadata
        self.chunk_shape = tuple(sharding.chunk_shape)
        shard_shape = tuple(array.metadata.chunk_grid.chunk_shape)
        self.rows, self.rows_per_shard = array.metadata.shape[0], shard_shape[0]
        self.row_name = "samples" if (array.metadata.dimension_names or ("",))[0] == "sample" else "rows"
        self.per_shard = tuple(s // c for s, c in zip(shard_shape, self.chunk_shape))
        self.index_bytes = 16 * math.prod(self.per_shard) + 4
        self.dtype = np.dtype(array.dtype)
        self.chunk_nbytes = math.prod(self.chunk_shape) * self.dtype.itemsize
        self.filters, self.compressors, self.checksummed, self.serializer = [], [], False, None
        for codec in sharding.codecs:
            if isinstance(codec, BytesCodec):
                self.dtype = self.dtype.newbyteorder("<" if codec.endian in (None, "little") else ">")
            elif isinstance(codec, Crc32cCodec):
                self.checksummed = True
            elif isinstance(codec, (BloscCodec, ZstdCodec)):
                self.compressors.append(numcodecs.Blosc() if isinstance(codec, BloscCodec) else numcodecs.Zstd())
            elif isinstance(codec, ArrayBytesCodec):     # a numcodecs serializer: bytes -> values
                self.serializer = _numcodec(codec)
            else:
                self.filters.append(_numcodec(codec))
        self._index_cache = BoundedCache()

    def _index(self, shard: tuple[int, ...], refresh: bool = False) -> np.ndarray:
        """The shard's checked index ``[*per_shard, 2]`` (offset, nbytes), read once and cached (``refresh``: read
        again)."""
        index = None if refresh else self._index_cache.get(shard)
        if index is None:
            key = self._key(shard)
            try:
                tail, size = self.files.tail(key, self.index_bytes)
            except FileNotFoundError:
                raise DamagedStoreError(f"{self.where(shard)} is missing: every shard of a complete store is "
                                        f"written (the store is damaged; {REPAIR})") from None
            if size < self.index_bytes:
                raise DamagedStoreError(f"{self.where(shard)}: {size} bytes, shorter than its "
                                        f"{self.index_bytes}-byte shard index (the file is truncated; {REPAIR})")
            raw = _checked(tail, f"{self.where(shard)} (shard index)")[0]
            index = raw.view("<u8").reshape(*self.per_shard, 2).copy()   # not a view of the read buffer
            stored = index[..., 0] != _EMPTY
            if np.any(index[..., 0][stored] + index[..., 1][stored] > size - self.index_bytes):
                raise DamagedStoreError(f"{self.where(shard)}: its shard index points past the chunk data "
                                        f"(the file is truncated or damaged; {REPAIR})")
            self._index_cache.put(shard, index)
        return index

    def _key(self, shard: tuple[int, ...]) -> str:
        return f"{self.folder}/{self.metadata.encode_chunk_key(shard)}"

    def where(self, shard: tuple[int, ...]) -> str:
        """The shard's file (or object) and the samples (rows) it holds, for error messages."""
        begin = shard[0] * self.rows_per_shard
        return (f"{self.files.name(self._key(shard))} ({self.row_name} "
                f"[{begin}, {min(begin + self.rows_per_shard, self.rows)}))")

    def clear(self) -> None:
        """Forgets the cached shard indexes (the files may have been replaced)."""
        self._index_cache.clear()

    def shard_of(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        """The shard that holds the chunk at ``coords``."""
        return tuple(c // p for c, p in zip(coords, self.per_shard))

    def stored_checksums(self, coords: tuple[int, ...]) -> np.ndarray:
        """The stored CRC32C of every chunk of the shard holding ``coords``, ``[*per_shard]`` uint32 (0 where a
        chunk is not stored), read fresh from the file (its index checked); what a writer binds to their places."""
        shard = self.shard_of(coords)
        index = self._index(shard, refresh=True)
        checksums = np.zeros(self.per_shard, dtype=np.uint32)
        stored = list(zip(*np.nonzero(index[..., 0] != _EMPTY)))
        spans = [(int(index[local][0] + index[local][1] - 4), 4) for local in stored]
        for local, raw in zip(stored, self.files.ranges(self._key(shard), spans)):
            checksums[local] = int.from_bytes(raw, "little")
        return checksums

    def read(self, coords: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """(the decoded inner chunk at chunk-grid coordinates ``coords``, its stored (and checked) CRC32C)."""
        return self.read_many([coords])[0]

    def read_many(self, coords_list: list[tuple[int, ...]]) -> list[tuple[np.ndarray, int]]:
        """:meth:`read` of each of ``coords_list``; the chunks of one shard fetched together (one request for
        neighbours on object storage)."""
        by_shard: dict[tuple[int, ...], list[int]] = {}
        for position, coords in enumerate(coords_list):
            by_shard.setdefault(self.shard_of(coords), []).append(position)
        out: list = [None] * len(coords_list)
        for shard, positions in by_shard.items():
            index = self._index(shard)
            spans = []
            for position in positions:
                local = tuple(c % p for c, p in zip(coords_list[position], self.per_shard))
                offset, nbytes = index[local]
                if offset == _EMPTY:
                    raise DamagedStoreError(f"{self.where(shard)}: chunk {local} is not stored (every chunk of a "
                                            f"complete store is; {REPAIR})")
                spans.append((int(offset), int(nbytes)))
            try:
                parts = self.files.ranges(self._key(shard), spans)
            except FileNotFoundError:
                raise DamagedStoreError(f"{self.where(shard)} is missing: every shard of a complete store is "
                                        f"written (the store is damaged; {REPAIR})") from None
            for position, data in zip(positions, parts):
                local = tuple(c % p for c, p in zip(coords_list[position], self.per_shard))
                out[position] = self._decode(data, shard, local)
        return out

    def _decode(self, data: bytes, shard: tuple[int, ...], local: tuple[int, ...]) -> tuple[np.ndarray, int]:
        checksum = None
        if self.checksummed:
            data, checksum = _checked(data, f"{self.where(shard)}, chunk {local}")
        for codec in reversed(self.compressors):
            data = codec.decode(data)
        values = np.frombuffer(data, dtype=self.dtype) if self.serializer is None else self.serializer.decode(data)
        for codec in reversed(self.filters):
            values = codec.decode(values)
        values = np.asarray(values).view(self.dtype)
        if values.nbytes != self.chunk_nbytes:
            raise DamagedStoreError(f"{self.where(shard)}: chunk {local} decodes to {values.nbytes} bytes, "
                                    f"expected {self.chunk_nbytes} ({REPAIR})")
        return values.reshape(self.chunk_shape), checksum


def open_chunk_reader(files, folder: str, array: zarr.Array) -> ShardedChunkReader | None:
    """A :class:`ShardedChunkReader` for ``array`` stored in the folder ``folder`` of ``files`` (a
    ``storage.LocalFolder`` or ``storage.ObjectPrefix``), or None for a layout it does not read."""
    codecs = array.metadata.codecs
    if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
        return None
    sharding = codecs[0]
    index_ok = (sharding.index_location == "end" and len(sharding.index_codecs) == 2
                and isinstance(sharding.index_codecs[0], BytesCodec)
                and isinstance(sharding.index_codecs[1], Crc32cCodec))
    inner = list(sharding.codecs)
    if inner and isinstance(inner[-1], Crc32cCodec):
        inner = inner[:-1]
    known = all(isinstance(c, (BytesCodec, BloscCodec, ZstdCodec)) or c.to_dict()["name"].startswith("numcodecs.")
                for c in inner)
    if not (index_ok and known):
        return None
    return ShardedChunkReader(files, folder, array, sharding)

