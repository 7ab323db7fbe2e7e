"""Megatron indexed datasets (``PREFIX.bin``/``PREFIX.idx``, read through megatron-core's ``IndexedDataset``; on
object storage, ``s3://`` or ``msc://``, as its object-storage reader does: ``object_tokens.py``): the checked
token stream (:func:`open_indexed`, which the stream layout cuts into windows) and its documents
(:func:`indexed_documents`).

Documents are the index's: document ``d`` is sequences ``document_indices[d] : document_indices[d + 1]``, back to
back in the ``.bin``. One stored without the end-of-document id at its end gets one appended (not stored); loss
targets follow the text rule (``document_set.py``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_kd_plugin.cache.sources.document_set import DocumentMasks, DocumentSet
from megatron_kd_plugin.cache.sources.source_files import LoadedTokenizer, file_digest
from megatron_kd_plugin.cache.store.storage import is_object_url

_BLOCK_TOKENS = 1 << 24
"""The widest span of tokens read at once when the last token of every document is looked up."""


@dataclass(frozen=True)
class IndexedTokens:
    """An indexed dataset, checked: its tokens and index."""

    stream: object
    """int [T]: every token, back to back (a memmap of the ``.bin``, or ``object_tokens.RangedTokens``)."""
    index: object
    """megatron-core's ``_IndexReader`` of the ``.idx``: ``sequence_lengths``, ``document_indices``, ``dtype``."""
    content: Callable[[], str]
    """Computes the SHA-256 of the two files (``source_files.file_digest``)."""
    bin_name: str


def open_indexed(prefix: str) -> IndexedTokens:
    """The indexed dataset ``prefix``; ValueError (one line) for a missing, truncated or foreign file, and for one
    without tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexReader

    remote = is_object_url(prefix)
    if remote:
        from megatron_kd_plugin.cache.sources.object_tokens import ObjectIndexedDataset

        objects = ObjectIndexedDataset(prefix)
        index_file, bin_name, size, content = objects.cached_index(), objects.bin_name, objects.bin_size, \
            objects.digest
    else:
        paths = [pathlib.Path(prefix + suffix) for suffix in (".idx", ".bin")]
        for path in paths:
            if not path.is_file():
                raise ValueError(f"indexed dataset file {path} does not exist (--data takes the PREFIX of "
                                 "PREFIX.bin/PREFIX.idx)")
        index_file, bin_name, size = paths[0], str(paths[1]), paths[1].stat().st_size
        content = lambda: file_digest(paths)                                  # noqa: E731
    check_index_file(index_file)
    if size == 0:
        raise ValueError(f"{bin_name} is empty: the indexed dataset holds no tokens")
    index = _IndexReader(str(index_file), multimodal=False) if remote else \
        IndexedDataset(prefix, multimodal=False, mmap=True).index
    ends = index.sequence_pointers + index.sequence_lengths.astype(np.int64) * index.dtype_size
    if len(ends) and (index.sequence_pointers[0] != 0 or np.any(index.sequence_pointers[1:] != ends[:-1])):
        raise ValueError(f"{bin_name} does not store its documents back to back")
    total = int(index.sequence_lengths.sum())
    if total == 0:
        raise ValueError(f"indexed dataset {prefix} holds no tokens")
    needed = total * index.dtype_size
    if size < needed:
        raise ValueError(f"{bin_name} holds {size} bytes but {index_file} describes {total} tokens of "
                         f"{np.dtype(index.dtype).name} ({needed} bytes): the .bin is truncated or belongs to "
                         "another .idx")
    # the documents lie back to back in the .bin: the stream is the file itself, memory-mapped (on object storage:
    # read by ranges)
    stream = objects.tokens(index.dtype, total) if remote else \
        np.memmap(paths[1], dtype=index.dtype, mode="r", shape=(total,))
    return IndexedTokens(stream, index, content, bin_name)


def check_index_file(path: pathlib.Path) -> None:
    """ValueError naming ``path`` unless it is a whole Megatron ``.idx`` file (header, version 1, a known dtype
    code, and exactly the bytes its counts describe), checked before megatron-core's reader asserts on it."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    data = path.read_bytes()[:34]
    size = path.stat().st_size
    problem = None
    if len(data) < 34 or data[:9] != _INDEX_HEADER:
        problem = f"{size} bytes without the indexed-dataset header" if data[:9] != _INDEX_HEADER else \
            f"{size} bytes, shorter than the 34-byte header (truncated)"
    else:
        version, code = int.from_bytes(data[9:17], "little"), data[17]
        sequences, documents = int.from_bytes(data[18:26], "little"), int.from_bytes(data[26:34], "little")
        expected = 34 + sequences * (4 + 8) + documents * 8
        if version != 1 or code not in {member.value for member in DType}:
            problem = f"index version {version}, dtype code {code} (expected version 1 and a megatron dtype code)"
        elif size != expected:
            problem = (f"{size} bytes, but its header describes {sequences} sequences and {documents} document "
                       f"boundaries ({expected} bytes): truncated or damaged")
    if problem:
        raise ValueError(f"{path} is not a Megatron indexed-dataset index: {problem}")


def indexed_documents(prefix: str, tokenizer: LoadedTokenizer, *,
                      masks: DocumentMasks = DocumentMasks()) -> DocumentSet:
    """The documents of the indexed dataset ``prefix``; ``tokenizer`` gives the end-of-document id."""
    eod = tokenizer.require_eod(f"the documents of indexed dataset {prefix}")
    data = open_indexed(prefix)
    sequence_ends = np.concatenate([[0], np.cumsum(data.index.sequence_lengths, dtype=np.int64)])
    offsets = sequence_ends[np.asarray(data.index.document_indices, dtype=np.int64)]
    stored = np.diff(offsets)
    appended = np.ones(len(stored), dtype=bool)
    filled = np.flatnonzero(stored > 0)
    appended[filled] = _tokens_at(data.stream, offsets[filled + 1] - 1) != eod
    return DocumentSet(kind="indexed", tokens=data.stream, offsets=offsets, targets=None, appended=appended,
                       eod_id=eod, masks=masks, content=data.content, tokenizer=tokenizer.identity,
                       tokenizer_vocab_size=tokenizer.vocab_size, name=data.bin_name)


def _tokens_at(stream, positions: np.ndarray) -> np.ndarray:
    """int64: ``stream[positions]`` (ascending), read in spans of at most :data:`_BLOCK_TOKENS` tokens."""
    found, begin = [], 0
    while begin < len(positions):
        end = int(np.searchsorted(positions, positions[begin] + _BLOCK_TOKENS, side="left"))
        found.append(np.asarray(stream[positions[begin:end]], dtype=np.int64))
        begin = end
    return np.concatenate(found) if found else np.zeros(0, np.int64)
