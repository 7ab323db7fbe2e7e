"""The objects of a Megatron indexed dataset on object storage (``s3://BUCKET/PATH/PREFIX``,
``msc://PROFILE/PATH/PREFIX``), read as a token source (``sources.indexed_dataset_windows``) the way megatron-core's
``IndexedDataset`` reads one (``megatron.core.datasets.object_storage_utils``): the ``.idx`` copied once to a local
cache (megatron-core's ``get_index_cache_path`` under :data:`INDEX_CACHE`, refreshed when the object's ETag
changes), the ``.bin`` read by byte range, a block of windows (one writer's shard) per request, through the
store's client (``storage.py``).

The fingerprint is the SHA-256 of the two files' bytes, as for a local copy (``sources.file_digest``), so a store
cached from the bucket and one cached from a local copy of the same files are the same store.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np

from megatron_kd_plugin.cache.store import storage

INDEX_CACHE = pathlib.Path(os.environ.get("KD_INDEX_CACHE", "~/.cache/megatron_kd_plugin/idx")).expanduser()
"""Where the ``.idx`` files of object-storage token data are cached (the ``KD_INDEX_CACHE`` variable)."""
_BLOCK_BYTES = 1 << 26
"""Bytes read per request when a file is hashed."""


class RangedTokens:
    """The tokens of the ``.bin`` object ``key`` of ``folder`` as a read-only 1-D array: ``len``, slices and integer
    index arrays, each read by one byte-range request over the span it covers."""

    def __init__(self, folder: storage.ObjectPrefix, key: str, dtype, length: int):
        self.folder, self.key, self.dtype, self.length = folder, key, np.dtype(dtype), length

    def __len__(self) -> int:
        return self.length

    def _span(self, begin: int, end: int) -> np.ndarray:
        if end <= begin:
            return np.zeros(0, dtype=self.dtype)
        size = self.dtype.itemsize
        data = self.folder.ranges(self.key, [(begin * size, (end - begin) * size)])[0]
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, index):
        if isinstance(index, slice):
            begin, end, step = index.indices(self.length)
            return self._span(begin, end)[::step]
        index = np.asarray(index)
        if index.size == 0:
            return np.zeros(index.shape, dtype=self.dtype)
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= self.length:
            raise IndexError(f"token {low if low < 0 else high} outside {self.length} tokens")
        return self._span(low, high + 1)[index - low]


class ObjectIndexedDataset:
    """The ``.idx`` and ``.bin`` objects of the indexed dataset at the object-storage URL ``prefix``; ValueError
    (one line) when one does not exist. ``sources.indexed_dataset_windows`` checks and reads them."""

    def __init__(self, prefix: str):
        folder_url, _, stem = prefix.rstrip("/").rpartition("/")
        self.prefix, self.folder = prefix, storage.ObjectPrefix.from_url(folder_url)
        self.keys = [f"{stem}{suffix}" for suffix in (".idx", ".bin")]
        self.heads = [self.folder.head(key) for key in self.keys]
        for key, head in zip(self.keys, self.heads):
            if head is None:
                raise ValueError(f"indexed dataset file {self.folder.name(key)} does not exist (--data takes the "
                                 "PREFIX of PREFIX.bin/PREFIX.idx)")
        self.bin_name, self.bin_size = self.folder.name(self.keys[1]), self.heads[1]["size"]

    def cached_index(self) -> pathlib.Path:
        """The local copy of the ``.idx`` (megatron-core's ``get_index_cache_path`` under :data:`INDEX_CACHE`)."""
        from megatron.core.datasets.object_storage_utils import ObjectStorageConfig, get_index_cache_path

        local = pathlib.Path(get_index_cache_path(f"{self.prefix}.idx", ObjectStorageConfig(str(INDEX_CACHE))))
        _cache_index(self.folder, self.keys[0], self.heads[0], local)
        return local

    def tokens(self, dtype, length: int) -> RangedTokens:
        return RangedTokens(self.folder, self.keys[1], dtype, length)

    def digest(self) -> str:
        """``sources.file_digest`` of the two objects."""
        return _digest(self.folder, self.keys, [head["size"] for head in self.heads])


def _cache_index(folder: storage.ObjectPrefix, key: str, head: dict, local: pathlib.Path) -> None:
    """Copies the ``.idx`` object to ``local`` unless the copy there is of the same ETag (recorded beside it)."""
    tag = local.with_name(local.name + ".etag")
    if local.is_file() and tag.is_file() and tag.read_text() == head["e_tag"]:
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(f"{local.name}.{os.getpid()}.partial")
    partial.write_bytes(folder.get(key))
    os.replace(partial, local)
    tag.write_text(head["e_tag"] or "")


def _digest(folder: storage.ObjectPrefix, keys: list[str], sizes: list[int]) -> str:
    """``sources.file_digest`` of the objects ``keys`` (read by ranges of :data:`_BLOCK_BYTES`)."""
    digest = hashlib.sha256()
    for key, size in zip(keys, sizes):
        for begin in range(0, size, _BLOCK_BYTES):
            digest.update(folder.ranges(key, [(begin, min(_BLOCK_BYTES, size - begin))])[0])
    return digest.hexdigest()
