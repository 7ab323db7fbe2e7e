"""The ``stream`` row source of the cache writer: fixed windows of ``seq_length + 1`` tokens.

The documents of a source are concatenated into one token stream (JSONL: each document followed by the
tokenizer's end-of-text id when it has one) and cut like Megatron's GPTDataset: window i is
``stream[i·S : i·S + S + 1]`` (consecutive windows share one token), so there are ``(len(stream) − 1) // S``.

Two sources: a Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``, read through
``megatron.core.datasets.indexed_dataset.IndexedDataset``; on object storage, ``s3://`` or ``msc://``, as its
object-storage reader does: ``object_tokens.py``) and JSONL text with a ``tokenizers`` tokenizer.json
(or, when ``transformers`` is installed, any name/folder ``AutoTokenizer`` accepts). Each source has a content
``fingerprint`` (SHA-256 of its files, the windowing and the sample count) that the store records.

Every row source (this one, and the documents layouts' of ``cache/layouts/``) has ``len``, ``seq_length``,
``tokenizer``, ``tokenizer_vocab_size``, ``name``, ``summary``, ``windows(begin, end)``, ``row_masks(begin, end)``,
``layout`` and ``packing``. A stream row's loss mask is all ones and its positions are 0..S-1: the teacher attends
across the documents in a window, as Megatron's pretraining does.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_kd_plugin.cache.sources.indexed_documents import open_indexed
from megatron_kd_plugin.cache.sources.source_files import is_jsonl, load_tokenizer
from megatron_kd_plugin.cache.sources.text_documents import text_documents
from megatron_kd_plugin.cache.store.format import local_path
from megatron_kd_plugin.cache.store.storage import is_object_url


_BLOCK_TOKENS = 1 << 24
"""Tokens read at a time when a source is scanned for its token range."""


@dataclass(frozen=True)
class SourceSummary:
    """What a writer checks and records of its whole source: one pass over it (:attr:`TokenWindows.summary`)."""

    fingerprint: str
    """SHA-256 of the content, the windowing and the sample count (the store's ``fingerprint``)."""
    low: int
    """The smallest token id of the windows."""
    high: int
    """The largest token id of the windows."""


class RowSource:
    """What every row source derives from its :attr:`summary` (a ``SourceSummary``, computed by the subclass)."""

    summary: SourceSummary

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the source's content, how it is cut into rows and the row count."""
        return self.summary.fingerprint

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id of the rows."""
        return self.summary.low, self.summary.high


class TokenWindows(RowSource):
    """``len(self)`` windows of ``seq_length + 1`` tokens over one token stream (see the module docstring).

    ``fingerprint``: the content hash of the source (or a function computing it, called once when first needed: a
    10^10-token file takes minutes to hash, so a writer of many ranks computes :attr:`summary` on one rank and hands
    the others its value, ``writer.share_summary``).
    """

    def __init__(self, stream: np.ndarray, seq_length: int, *, num_samples: int | None,
                 fingerprint: str | Callable[[], str], tokenizer: str, tokenizer_vocab_size: int | None,
                 name: str = "the token data"):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        available = max(0, (len(stream) - 1) // seq_length)
        if num_samples is None:
            num_samples = available
        if num_samples < 1 or num_samples > available:
            raise ValueError(f"num_samples={num_samples}: the data hold {len(stream)} tokens, i.e. {available} "
                             f"windows of seq_length={seq_length} (+1)")
        self.stream, self.seq_length, self.num_samples = stream, seq_length, num_samples
        self.tokenizer, self.tokenizer_vocab_size, self.name = tokenizer, tokenizer_vocab_size, name
        self._content = fingerprint if callable(fingerprint) else (lambda: fingerprint)

    layout = "stream"
    """The row layout (``cache/layouts/``), which the store records."""
    packing: dict = {}
    """How documents fill the rows: nothing to say of a stream."""

    def __len__(self) -> int:
        return self.num_samples

    def windows(self, begin: int, end: int) -> np.ndarray:
        """int64 ``[end - begin, S + 1]``: windows begin..end-1."""
        s = self.seq_length
        starts = np.arange(begin, end, dtype=np.int64)[:, None] * s + np.arange(s + 1, dtype=np.int64)[None, :]
        return self.stream[starts].astype(np.int64)

    def row_masks(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(loss_mask uint8 ``[b, S]``, all ones; position_ids int32 ``[b, S]``, 0..S-1 in every row) of windows
        begin..end-1, b = end - begin."""
        shape = (end - begin, self.seq_length)
        return np.ones(shape, np.uint8), np.broadcast_to(np.arange(self.seq_length, dtype=np.int32), shape).copy()

    @functools.cached_property
    def summary(self) -> SourceSummary:
        """The source's fingerprint and token range, computed once (streamed: memory independent of its size)."""
        fingerprint = hashlib.sha256(f"{self._content()}|S={self.seq_length}|N={self.num_samples}".encode())
        used, low, high = self.num_samples * self.seq_length + 1, None, None
        for begin in range(0, used, _BLOCK_TOKENS):
            block = np.asarray(self.stream[begin:min(begin + _BLOCK_TOKENS, used)])
            low = int(block.min()) if low is None else min(low, int(block.min()))
            high = int(block.max()) if high is None else max(high, int(block.max()))
        return SourceSummary(fingerprint.hexdigest(), low, high)



def indexed_dataset_windows(prefix: str, seq_length: int, *, num_samples: int | None = None,
                            tokenizer: str = "") -> TokenWindows:
    """Windows over a Megatron indexed dataset ``prefix`` (``.bin``/``.idx``); ``tokenizer``: its identity."""
    data = open_indexed(prefix)
    return TokenWindows(data.stream, seq_length, num_samples=num_samples, fingerprint=data.content,
                        tokenizer=tokenizer, tokenizer_vocab_size=None, name=data.bin_name)


def jsonl_windows(path: str, tokenizer: str, seq_length: int, *, num_samples: int | None = None,
                  text_key: str = "text") -> TokenWindows:
    """Windows over the documents ``json[text_key]`` of the JSONL file ``path``, tokenized by ``tokenizer``."""
    documents = text_documents(path, load_tokenizer(tokenizer), text_key=text_key)
    return TokenWindows(documents.tokens, seq_length, num_samples=num_samples, fingerprint=documents.content,
                        tokenizer=documents.tokenizer, tokenizer_vocab_size=documents.tokenizer_vocab_size,
                        name=documents.name)


def open_source(data: str, seq_length: int, *, tokenizer: str | None = None, num_samples: int | None = None,
                text_key: str = "text") -> TokenWindows:
    """``data`` ending in .jsonl/.json: JSONL text (needs ``tokenizer``); else an indexed-dataset prefix, local or
    on object storage (``s3://``, ``msc://``: ``object_tokens.py``)."""
    check_data(data, tokenizer)
    if is_jsonl(data):
        return jsonl_windows(data, tokenizer, seq_length, num_samples=num_samples, text_key=text_key)
    identity = ""
    vocab_size = None
    if tokenizer:
        loaded = load_tokenizer(tokenizer)
        identity, vocab_size = loaded.identity, loaded.vocab_size
    windows = indexed_dataset_windows(data, seq_length, num_samples=num_samples, tokenizer=identity)
    windows.tokenizer_vocab_size = vocab_size
    return windows


def check_data(data: str, tokenizer: str | None) -> None:
    """ValueError (one line) unless ``data`` is a local path or an object-storage indexed dataset, and JSONL comes
    with a ``tokenizer``."""
    remote = is_object_url(data)
    if not remote:
        local_path(data, "token data")
    if is_jsonl(data):
        if remote:
            raise ValueError(f"{data}: JSONL token data on object storage is not supported; pass a Megatron indexed "
                             "dataset prefix there, or a local copy of the JSONL file")
        if not tokenizer:
            raise ValueError(f"JSONL data {data} needs --tokenizer (a tokenizer.json file or a HF name)")
