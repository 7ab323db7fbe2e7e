"""Checked reads of whole samples of a store (format: ``format.py``): each chunk through ``chunk_reader.py`` (its
CRC32C and its shard index's), bound to its place by ``chunk_records``, its token and teacher ids inside the
vocabulary; and a store replaced under an open reader is noticed and named.

The record of sample i's chunk of array a (format version 3)::

    chunk_records[i, column of a] = CRC32C(identity ‖ a ‖ 0x00 ‖ i (8 bytes LE) ‖ the chunk's stored CRC32C (4 B LE))

with ``identity`` the store's attribute (the SHA-256 of its format, version and settings, ASCII hex) and the
columns the per-sample arrays sorted by name (``format.bound_arrays``); one chunk holds the records of one shard.
A chunk moved within or between shard files, a shard file swapped with another or copied from a store of other
settings, a ``chunk_records`` file moved, or attributes edited with their identity recomputed, each fails this
comparison (a miss has probability 2^-32 per chunk): the chunk's own CRC32C stays valid, but it was written for
another place. (A shard copied from a store of the same settings holds the same bytes and passes: it is the same
data.) Reading a sample costs
one CRC32C over ~90 bytes per array, and once per shard the small uncompressed ``chunk_records`` chunk (cached
like the shard indexes).

A read that fails is retried once with the cached shard indexes dropped (the files may have been rewritten);
if it fails again and the store's attributes on disk (its identity) are no longer those this reader opened, the
error says the store was replaced.
"""

from __future__ import annotations

import json
import warnings

import google_crc32c
import numpy as np
import zarr

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store.chunk_reader import REPAIR, BoundedCache, DamagedStoreError, open_chunk_reader


def chunk_record(identity: str, name: str, sample: int, checksum: int) -> int:
    """The record that binds the chunk with stored CRC32C ``checksum`` to sample ``sample`` of array ``name`` of
    the store ``identity`` (see the module docstring)."""
    return google_crc32c.value(identity.encode() + name.encode() + b"\0" + int(sample).to_bytes(8, "little")
                               + int(checksum).to_bytes(4, "little"))


def shard_records(path, group: zarr.Group, spec: fmt.CacheSpec, shard: int) -> np.ndarray:
    """``chunk_records`` rows ``[end - begin, A]`` of shard ``shard``, from the stored CRC32Cs of the chunks just
    written (read back from the shard files)."""
    identity, names = group.attrs["identity"], fmt.bound_arrays(spec)
    begin, end = spec.shard_range(shard)
    records = np.zeros((end - begin, len(names)), dtype=np.uint32)
    for column, name in enumerate(names):
        array = group[name]
        checksums = open_chunk_reader(fmt.files_of(path), name, array).stored_checksums(
            (begin,) + (0,) * (array.ndim - 1)).reshape(-1)
        for row, sample in enumerate(range(begin, end)):
            records[row, column] = chunk_record(identity, name, sample, checksums[row])
    return records


VERIFY_BATCH = 64
"""Samples of a shard read together when verifying (one request per array on object storage)."""


class SampleReader:
    """``reader.read(i)`` -> {array name: sample i's chunk as numpy, on-disk dtype} for ``names`` (default: every
    per-sample array of the store), checked; :class:`DamagedStoreError` (a ValueError) naming the file, the samples
    and what to do."""

    def __init__(self, path, group: zarr.Group, spec: fmt.CacheSpec, names: list[str] | None = None):
        self.path, self.spec = fmt.store_location(path), spec
        self.files = fmt.files_of(self.path)
        self.version, self.identity = group.attrs["version"], group.attrs.get("identity")
        self.opened_attrs = self._described(dict(group.attrs))
        self.bound = fmt.bound_arrays(spec, self.version)
        if names is None:
            names = [name for name in fmt.sample_arrays(spec, self.version) if name != fmt.RECORDS]
        self.names = list(names)
        self.readers = {name: open_chunk_reader(self.files, name, group[name])
                        for name in self.names + [fmt.RECORDS] * bool(self.bound)}
        self._records = BoundedCache()
        if None in self.readers.values():              # open_store checked the layout
            raise ValueError(f"{self.path}: the store's arrays are not laid out as this reader reads them")
        if not self.bound:
            warnings.warn(f"{self.path} is a cache of format version {self.version}: its chunks are not bound to "
                          "their places and its attributes carry no checksum, so a moved, swapped or copied shard "
                          "file or an edited attribute would read back as data; rewrite it in version "
                          f"{spec.format_version} (rerun the cache command that wrote it, plus --overwrite)",
                          stacklevel=3)

    @staticmethod
    def _described(attrs: dict) -> dict:
        return {key: value for key, value in attrs.items() if key not in ("complete", "progress")}

    def read(self, sample: int, names=None) -> dict[str, np.ndarray]:
        """Sample ``sample``'s chunks of ``names`` (default: every array this reader was opened for), checked."""
        return self.read_many([sample], names)[0]

    def read_many(self, samples, names=None) -> list[dict[str, np.ndarray]]:
        """:meth:`read` of each of ``samples``, each array's chunks of one shard fetched together (one request for
        neighbours on object storage)."""
        samples = [int(sample) for sample in samples]
        try:
            return self._read(samples, names)
        except DamagedStoreError:
            for reader in self.readers.values():
                reader.clear()
            self._records.clear()
        try:
            return self._read(samples, names)
        except DamagedStoreError as exc:
            self._refuse_if_replaced(exc)
            raise

    def _read(self, samples: list[int], names=None) -> list[dict[str, np.ndarray]]:
        out: list[dict] = [{} for _ in samples]
        checksums: list[dict] = [{} for _ in samples]
        for name in self.names if names is None else [name for name in self.names if name in names]:
            reader = self.readers[name]
            rest = (0,) * (len(reader.chunk_shape) - 1)
            for row, (values, checksum) in enumerate(reader.read_many([(sample,) + rest for sample in samples])):
                out[row][name], checksums[row][name] = values[0], checksum
        for row, sample in enumerate(samples):
            if self.bound:
                records = self._shard_records(sample)[sample % self.spec.samples_per_shard]
                for column, name in enumerate(self.bound):
                    if name in checksums[row] and records[column] != chunk_record(self.identity, name, sample,
                                                                                  checksums[row][name]):
                        raise DamagedStoreError(self._misplaced(name, sample))
            self._check_ids(out[row], sample)
        return out

    def _shard_records(self, sample: int) -> np.ndarray:
        """The ``chunk_records`` rows ``[P, A]`` of the shard holding ``sample`` (one chunk, cached)."""
        shard = sample // self.spec.samples_per_shard
        records = self._records.get(shard)
        if records is None:
            records = self.readers[fmt.RECORDS].read((shard, 0))[0].copy()   # not a view of the read buffer
            self._records.put(shard, records)
        return records

    def _where(self, name: str, sample: int) -> str:
        reader = self.readers[name]
        coords = (sample // reader.chunk_shape[0],) + (0,) * (len(reader.chunk_shape) - 1)
        return reader.where(reader.shard_of(coords))

    def _misplaced(self, name: str, sample: int) -> str:
        return (f"{self._where(name, sample)}: the chunk of sample {sample} was not written there for this store "
                f"(its record in {self._where(fmt.RECORDS, sample)} does not match: the shard file, or that of "
                f"{fmt.RECORDS}, was moved, swapped or copied from another store; {REPAIR})")

    def _check_ids(self, out: dict[str, np.ndarray], sample: int) -> None:
        """Token and teacher ids inside the vocabulary; the ids of a row are sorted ascending, so its first and last
        bound it (a few comparisons per row)."""
        vocab = self.spec.vocab_size
        for name, values in ((fmt.TOKENS, out.get(fmt.TOKENS)), (fmt.IDS, out.get(fmt.IDS))):
            if values is None:
                continue
            low, high = (values.min(), values.max()) if values.ndim == 1 else \
                (values[..., 0].min(), values[..., -1].max())
            if low < 0 or high >= vocab:
                raise DamagedStoreError(f"{self._where(name, sample)}: sample {sample} holds the id "
                                        f"{low if low < 0 else high}, outside the teacher vocabulary [0, {vocab}) "
                                        f"of the store's attributes; {REPAIR}")

    def _refuse_if_replaced(self, exc: DamagedStoreError) -> None:
        try:
            now = self._described(json.loads(self.files.get("zarr.json")).get("attributes", {}))
        except (OSError, ValueError, AttributeError):
            now = None
        if now != self.opened_attrs:
            then, later = self.identity or "(version 2: none)", (now or {}).get("identity", "none")
            raise DamagedStoreError(
                f"{self.path} was replaced (or removed) since this reader opened it (store identity {then!r:.20} "
                f"then, {later!r:.20} now): open a new reader on it ({exc})") from exc

    def verify(self, shards) -> dict[int, str]:
        """{shard: the first damage found in it} over ``shards``, every sample of each read and checked (one process;
        :func:`verify_shards` spreads a store over several)."""
        damaged = {}
        for shard in shards:
            samples = range(*self.spec.shard_range(int(shard)))
            for begin in range(0, len(samples), VERIFY_BATCH):
                try:
                    self._read(list(samples[begin:begin + VERIFY_BATCH]))
                except DamagedStoreError as exc:
                    damaged[int(shard)] = str(exc)
                    break
        return damaged


def _verify_block(path: str, shards: list[int]) -> dict[int, str]:
    """:meth:`SampleReader.verify` of ``shards`` of the store at ``path``, in a process of its own."""
    group, spec = fmt.open_store(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # the parent has shown the format's warnings
        return SampleReader(path, group, spec).verify(shards)


PROCESS_TOKENS = 1 << 23
"""The least tokens worth a verifying process of their own (a process starts in ~2 s, reads ~1-2 M tokens/s)."""


def verify_shards(path, group: zarr.Group, spec: fmt.CacheSpec, shards, *, workers: int = 1, progress: bool = False,
                  process_tokens: int = PROCESS_TOKENS) -> dict[int, str]:
    """{shard: the first damage found in it} over ``shards`` of the store at ``path``, every sample read and checked
    by up to ``workers`` processes at once, one per ``process_tokens`` tokens at least (each a block of shards at a
    time; a small store is read in this process); ``progress``: a bar on stderr."""
    from tqdm import tqdm

    shards = [int(shard) for shard in shards]
    tokens = sum(end - begin for begin, end in map(spec.shard_range, shards)) * spec.seq_length
    workers = min(workers, len(shards), max(1, tokens // max(1, process_tokens)))
    if workers <= 1:
        return SampleReader(path, group, spec).verify(tqdm(shards, unit="shard", desc="verifying",
                                                           disable=not progress))
    import concurrent.futures
    import multiprocessing

    size = max(1, len(shards) // (workers * 8))          # blocks small enough to balance the processes
    blocks = [shards[i:i + size] for i in range(0, len(shards), size)]
    damaged: dict[int, str] = {}
    # spawn: zarr's event-loop thread does not survive a fork
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool, \
            tqdm(total=len(shards), unit="shard", desc=f"verifying ({workers} processes)", disable=not progress) as bar:
        for block, found in zip(blocks, pool.map(_verify_block, [str(path)] * len(blocks), blocks)):
            damaged |= found
            bar.update(len(block))
    return dict(sorted(damaged.items()))
