"""Token sources for the cache writer: fixed windows of ``seq_length + 1`` tokens.

The documents of a source are concatenated into one token stream (JSONL: each document followed by the
tokenizer's end-of-text id when it has one) and cut like Megatron's GPTDataset: window i is
``stream[i·S : i·S + S + 1]`` (consecutive windows share one token), so there are ``(len(stream) − 1) // S``.

Two sources: a Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``, read through
``megatron.core.datasets.indexed_dataset.IndexedDataset``; on object storage, ``s3://`` or ``msc://``, as its
object-storage reader does: ``object_tokens.py``) and JSONL text with a ``tokenizers`` tokenizer.json
(or, when ``transformers`` is installed, any name/folder ``AutoTokenizer`` accepts). Each source has a content
``fingerprint`` (SHA-256 of its files, the windowing and the sample count) that the store records.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_kd_plugin.cache.store.format import local_path
from megatron_kd_plugin.cache.store.storage import is_object_url


def file_digest(paths, extra: str = "") -> str:
    """SHA-256 over the contents of ``paths`` (in the given order) and ``extra``."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    digest.update(extra.encode())
    return digest.hexdigest()


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


class TokenWindows:
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

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the source's content, the windowing (seq_length) and the sample count."""
        return self.summary.fingerprint

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id of the windows."""
        return self.summary.low, self.summary.high


def indexed_dataset_windows(prefix: str, seq_length: int, *, num_samples: int | None = None,
                            tokenizer: str = "") -> TokenWindows:
    """Windows over a Megatron indexed dataset ``prefix`` (``.bin``/``.idx``); ``tokenizer``: its identity."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexReader

    if is_object_url(prefix):
        from megatron_kd_plugin.cache.sources.object_tokens import ObjectIndexedDataset

        remote = ObjectIndexedDataset(prefix)
        index_file, bin_name, size, fingerprint = remote.cached_index(), remote.bin_name, remote.bin_size, \
            remote.digest
    else:
        paths = [pathlib.Path(prefix + suffix) for suffix in (".idx", ".bin")]
        for path in paths:
            if not path.is_file():
                raise ValueError(f"indexed dataset file {path} does not exist (--data takes the PREFIX of "
                                 "PREFIX.bin/PREFIX.idx)")
        index_file, bin_name, size = paths[0], str(paths[1]), paths[1].stat().st_size
        fingerprint = lambda: file_digest(paths)                                  # noqa: E731
    check_index_file(index_file)
    if size == 0:
        raise ValueError(f"{bin_name} is empty: the indexed dataset holds no tokens")
    index = _IndexReader(str(index_file), multimodal=False) if is_object_url(prefix) else \
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
    stream = remote.tokens(index.dtype, total) if is_object_url(prefix) else \
        np.memmap(paths[1], dtype=index.dtype, mode="r", shape=(total,))
    return TokenWindows(stream, seq_length, num_samples=num_samples, fingerprint=fingerprint,
                        tokenizer=tokenizer, tokenizer_vocab_size=None, name=bin_name)


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


def load_tokenizer(name: str):
    """(encode: str -> list[int], end-of-text id or None, vocab size, identity) for a tokenizer.json or HF name."""
    path = pathlib.Path(name)
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:                         # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"tokenizer {path} is not a valid tokenizer.json ({exc})") from exc
        eos = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
                    if tok.token_to_id(t) is not None), None)
        identity = f"{path.name}:sha256={file_digest([path])[:16]}"
        return (lambda text: tok.encode(text).ids), eos, tok.get_vocab_size(), identity
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(f"tokenizer {name!r} is not a file and transformers is not installed") from exc
    tok = AutoTokenizer.from_pretrained(name)
    return (lambda text: tok(text, add_special_tokens=False)["input_ids"]), tok.eos_token_id, len(tok), name


def jsonl_windows(path: str, tokenizer: str, seq_length: int, *, num_samples: int | None = None,
                  text_key: str = "text") -> TokenWindows:
    """Windows over the documents ``json[text_key]`` of the JSONL file ``path``, tokenized by ``tokenizer``."""
    from tqdm import tqdm

    encode, eos, vocab_size, identity = load_tokenizer(tokenizer)
    ids: list[int] = []
    with open(path, "rb") as f:
        if f.read(4).startswith((b"\xff\xfe", b"\xfe\xff")):
            raise ValueError(f"{path} is UTF-16 encoded (a byte-order mark): JSONL must be UTF-8; convert it "
                             f"(iconv -f UTF-16 -t UTF-8 {path})")
        f.seek(0)
        for number, raw in enumerate(tqdm(f, desc="tokenizing", unit=" docs"), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}"
                                 "); JSONL must be UTF-8") from exc
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_key]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a JSON object with a {text_key!r} string ({exc})") from exc
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: {text_key!r} holds {type(text).__name__} {text!r:.40}, "
                                 "expected a string")
            ids.extend(encode(text))
            if eos is not None:
                ids.append(eos)
    return TokenWindows(np.asarray(ids, dtype=np.int64), seq_length, num_samples=num_samples,
                        fingerprint=lambda: file_digest([path], extra=identity), tokenizer=identity,
                        tokenizer_vocab_size=vocab_size, name=str(path))


def open_source(data: str, seq_length: int, *, tokenizer: str | None = None, num_samples: int | None = None,
                text_key: str = "text") -> TokenWindows:
    """``data`` ending in .jsonl/.json: JSONL text (needs ``tokenizer``); else an indexed-dataset prefix, local or
    on object storage (``s3://``, ``msc://``: ``object_tokens.py``)."""
    remote = is_object_url(data)
    if not remote:
        local_path(data, "token data")
    if data.endswith((".jsonl", ".json")):
        if remote:
            raise ValueError(f"{data}: JSONL token data on object storage is not supported; pass a Megatron indexed "
                             "dataset prefix there, or a local copy of the JSONL file")
        if not tokenizer:
            raise ValueError(f"JSONL data {data} needs --tokenizer (a tokenizer.json file or a HF name)")
        return jsonl_windows(data, tokenizer, seq_length, num_samples=num_samples, text_key=text_key)
    identity = ""
    vocab_size = None
    if tokenizer:
        _, _, vocab_size, identity = load_tokenizer(tokenizer)
    windows = indexed_dataset_windows(data, seq_length, num_samples=num_samples, tokenizer=identity)
    windows.tokenizer_vocab_size = vocab_size
    return windows
