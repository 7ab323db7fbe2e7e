"""What every source reads its input with: the content hash of files (:func:`file_digest`), the tokenizer
(:func:`load_tokenizer`) and the records of a JSONL file, each bad line refused in one line naming ``file:line``
(:func:`jsonl_records`)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator


JSONL_SUFFIXES = (".jsonl", ".json")
"""The file names read as JSONL (any other ``--data`` is an indexed-dataset prefix)."""


def is_jsonl(data: str) -> bool:
    """``data`` names a JSONL file (else an indexed-dataset prefix)."""
    return data.endswith(JSONL_SUFFIXES)


def file_digest(paths, extra: str = "") -> str:
    """SHA-256 over the contents of ``paths`` (in the given order) and ``extra``."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    digest.update(extra.encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer as the sources use it."""

    encode: Callable[[str], list[int]]
    """Text -> token ids, no special tokens added."""
    eod_id: int | None
    """The end-of-document id every document ends with (the tokenizer's end-of-text / eos token), None if it has
    none."""
    vocab_size: int
    """The tokenizer's vocabulary size (added tokens included)."""
    identity: str
    """What the store records as the tokenizer (a file name with its hash, or the name given)."""
    hf: Any = None
    """The ``transformers`` tokenizer (chat templates render through it), None for a bare tokenizer.json."""

    def require_eod(self, why: str) -> int:
        """The end-of-document id; ValueError saying ``why`` it is needed when the tokenizer has none."""
        if self.eod_id is None:
            raise ValueError(f"{why} needs the tokenizer's end-of-document id, and tokenizer {self.identity!r} has "
                             "none (an end-of-text / eos token)")
        return self.eod_id


def load_tokenizer(name: str) -> LoadedTokenizer:
    """The tokenizer of a tokenizer.json file or a name/folder ``transformers.AutoTokenizer`` accepts."""
    path = pathlib.Path(name)
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:                         # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"tokenizer {path} is not a valid tokenizer.json ({exc})") from exc
        eod = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
                    if tok.token_to_id(t) is not None), None)
        identity = f"{path.name}:sha256={file_digest([path])[:16]}"
        return LoadedTokenizer(lambda text: tok.encode(text).ids, eod, tok.get_vocab_size(), identity)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(f"tokenizer {name!r} is not a file and transformers is not installed") from exc
    tok = AutoTokenizer.from_pretrained(name)
    return LoadedTokenizer(lambda text: tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id, len(tok),
                           name, hf=tok)


def jsonl_records(path, *, progress: str = "tokenizing") -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON value) of every non-blank line of the UTF-8 JSONL file ``path``; ValueError naming
    ``path:line`` for a line that is not UTF-8 or not JSON, and for a UTF-16 file."""
    from tqdm import tqdm

    with open(path, "rb") as f:
        if f.read(4).startswith((b"\xff\xfe", b"\xfe\xff")):
            raise ValueError(f"{path} is UTF-16 encoded (a byte-order mark): JSONL must be UTF-8; convert it "
                             f"(iconv -f UTF-16 -t UTF-8 {path})")
        f.seek(0)
        for number, raw in enumerate(tqdm(f, desc=progress, unit=" docs"), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}"
                                 "); JSONL must be UTF-8") from exc
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc


def string_field(record: Any, key: str, where: str) -> str:
    """``record[key]``, a string; ValueError naming ``where`` (``file:line``) when ``record`` is no JSON object with
    a string there."""
    if not isinstance(record, dict) or key not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: not a JSON object with a {key!r} string (it has {keys})")
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} holds {type(value).__name__} {value!r:.40}, expected a string")
    return value
