"""A Megatron indexed dataset on object storage (``s3://BUCKET/PATH/PREFIX``, ``msc://PROFILE/PATH/PREFIX``) as a
token source, the way megatron-core's ``IndexedDataset`` reads one (``megatron.core.datasets.object_storage_utils``):
the ``.idx`` copied once to a local cache (megatron-core's ``get_index_cache_path`` under
:data:`INDEX_CACHE`, refreshed when the object's ETag changes), the ``.bin`` read by byte range, a block of
windows (one writer's shard) per request, through the store's client (``storage.py``).

The fingerprint is the SHA-256 of the two files' bytes, as for a local copy (``sources.file_digest``), so a store
cached from the bucket and one cached from a local copy of the same files are the same store.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np

from megatron_kd_plugin.cache import storage

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


def object_indexed_windows(prefix: str, seq_length: int, *, num_samples: int | None = None, tokenizer: str = ""):
    """``sources.TokenWindows`` over the indexed dataset at the object-storage URL ``prefix`` (module docstring)."""
    from megatron.core.datasets.indexed_dataset import _IndexReader
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig, get_index_cache_path

    from megatron_kd_plugin.cache.sources import TokenWindows, check_index_file

    folder_url, _, stem = prefix.rstrip("/").rpartition("/")
    folder = storage.ObjectPrefix.from_url(folder_url)
    keys = [f"{stem}{suffix}" for suffix in (".idx", ".bin")]
    heads = [folder.head(key) for key in keys]
    for key, head in zip(keys, heads):
        if head is None:
            raise ValueError(f"indexed dataset file {folder.name(key)} does not exist (--data takes the PREFIX of "
                             "PREFIX.bin/PREFIX.idx)")
    local_index = pathlib.Path(get_index_cache_path(f"{prefix}.idx", ObjectStorageConfig(str(INDEX_CACHE))))
    _cache_index(folder, keys[0], heads[0], local_index)
    check_index_file(local_index)
    if heads[1]["size"] == 0:
        raise ValueError(f"{folder.name(keys[1])} is empty: the indexed dataset holds no tokens")
    index = _IndexReader(str(local_index), multimodal=False)
    ends = index.sequence_pointers + index.sequence_lengths.astype(np.int64) * index.dtype_size
    if len(ends) and (index.sequence_pointers[0] != 0 or np.any(index.sequence_pointers[1:] != ends[:-1])):
        raise ValueError(f"{folder.name(keys[1])} does not store its documents back to back")
    total = int(index.sequence_lengths.sum())
    needed = total * index.dtype_size
    if total == 0:
        raise ValueError(f"indexed dataset {prefix} holds no tokens")
    if heads[1]["size"] < needed:
        raise ValueError(f"{folder.name(keys[1])} holds {heads[1]['size']} bytes but its .idx describes {total} "
                         f"tokens of {np.dtype(index.dtype).name} ({needed} bytes): the .bin is truncated or "
                         "belongs to another .idx")
    stream = RangedTokens(folder, keys[1], index.dtype, total)
    return TokenWindows(stream, seq_length, num_samples=num_samples,
                        fingerprint=lambda: _digest(folder, keys, [head["size"] for head in heads]),
                        tokenizer=tokenizer, tokenizer_vocab_size=None, name=folder.name(keys[1]))


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
