"""Token ids as bytes: the byte table of a ``tokenizers`` tokenizer, and loading a tokenizer with it.

A lossless tokenizer's tokens concatenate to the text they encode: token v stands for a fixed byte string, and a
token sequence is the concatenation of its tokens' strings. The byte table holds them all:

    bytes   uint8 [sum of lengths]      the strings, back to back
    offsets int64 [V + 1]               token v = bytes[offsets[v]:offsets[v + 1]] (ids the tokenizer lacks: b"")

The string of a token follows the tokenizer's decoder (``tokenizer.json``): ``ByteLevel`` (GPT-2, Llama 3, Qwen: each
character stands for one byte), ``Metaspace`` or ``Replace("▁", " ")`` (SentencePiece: "▁" is a space) with
``ByteFallback`` (``<0xNN>`` is byte NN); none: the token's UTF-8. Added (special) tokens are their content.
``WordPiece`` and other decoders that insert or drop characters are refused: their tokens do not concatenate to the
text. :func:`check_lossless` verifies the table on texts (a normaliser that rewrites the text is caught there).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import re

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_LOSSLESS_DECODERS = {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (character -> byte), rebuilt from its definition."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _decoders(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    return [d for item in spec.get("decoders", []) for d in _decoders(item)] if spec["type"] == "Sequence" else [spec]


class TokenBytes:
    """Token id -> bytes (``strings``, ``lengths``; the table ``bytes``/``offsets``), and, when made from a
    ``tokenizers.Tokenizer``, ``encode(text)`` / ``encode_batch(texts)`` (ids without special tokens added)."""

    def __init__(self, strings: list[bytes], *, tokenizer=None, identity: str = ""):
        self.strings, self.tokenizer, self.identity = strings, tokenizer, identity
        self.lengths = np.fromiter((len(b) for b in strings), dtype=np.int64, count=len(strings))    # [V]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)              # [V + 1]
        self.bytes = np.frombuffer(b"".join(strings), dtype=np.uint8)                              # [sum]

    @classmethod
    def from_tokenizer(cls, tokenizer, *, vocab_size: int | None = None, identity: str = "") -> "TokenBytes":
        """The table of ``tokenizer``, padded with empty strings to ``vocab_size`` ids (a model's padded rows)."""
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        strings = cls._strings(tokenizer, size)
        return cls(strings + [b""] * max(0, (vocab_size or 0) - size), tokenizer=tokenizer, identity=identity)

    @classmethod
    def from_arrays(cls, table: np.ndarray, offsets: np.ndarray, *, identity: str = "") -> "TokenBytes":
        """The table a store holds (``bytes``, ``offsets`` as above)."""
        data = np.asarray(table, dtype=np.uint8).tobytes()
        bounds = np.asarray(offsets, dtype=np.int64).tolist()
        return cls([data[a:b] for a, b in zip(bounds[:-1], bounds[1:])], identity=identity)

    @staticmethod
    def _strings(tokenizer, size: int) -> list[bytes]:
        spec = json.loads(tokenizer.to_str())
        decoders = _decoders(spec.get("decoder"))
        kinds = {d["type"] for d in decoders}
        if kinds - _LOSSLESS_DECODERS:
            raise ValueError(f"the tokenizer's decoder {sorted(kinds - _LOSSLESS_DECODERS)} does not concatenate "
                             "tokens into their text (e.g. WordPiece); cross-tokenizer distillation needs a lossless "
                             "tokenizer (byte-level BPE, SentencePiece/Metaspace)")
        added = {token["id"]: token["content"] for token in spec.get("added_tokens", [])}
        alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
        replacements = [(d["pattern"].get("String", ""), d["content"]) for d in decoders if d["type"] == "Replace"]
        metaspace = next((d.get("replacement", "▁") for d in decoders if d["type"] == "Metaspace"), None)
        byte_fallback = "ByteFallback" in kinds
        strings = []
        for token_id in range(size):
            token = tokenizer.id_to_token(token_id)
            if token is None:
                strings.append(b"")
            elif token_id in added:
                strings.append(added[token_id].encode())
            elif byte_fallback and _BYTE_TOKEN.fullmatch(token):
                strings.append(bytes([int(token[3:5], 16)]))
            elif alphabet is not None:
                strings.append(bytes(alphabet[c] for c in token) if all(c in alphabet for c in token)
                               else token.encode())
            else:
                for pattern, content in replacements:
                    token = token.replace(pattern, content)
                if metaspace is not None:
                    token = token.replace(metaspace, " ")
                strings.append(token.encode())
        return strings

    @classmethod
    def load(cls, path, *, vocab_size: int | None = None) -> "TokenBytes":
        """From a ``tokenizer.json`` file or a folder holding one (a HF checkpoint or tokenizer folder)."""
        from tokenizers import Tokenizer

        file = pathlib.Path(path)
        if file.is_dir():
            file = file / TOKENIZER_FILE
        if not file.is_file():
            raise ValueError(f"{path}: no {TOKENIZER_FILE} there (the student tokenizer is a tokenizer.json file, or "
                             "a Hugging Face tokenizer / checkpoint folder holding one)")
        digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        return cls.from_tokenizer(Tokenizer.from_file(str(file)), vocab_size=vocab_size,
                                  identity=f"{file.name}:sha256={digest}")

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of the tokenizer's JSON (what decides its encodings), or of the byte table without one."""
        data = self.tokenizer.to_str().encode() if self.tokenizer is not None else \
            self.offsets.tobytes() + self.bytes.tobytes()
        return hashlib.sha256(data).hexdigest()

    def concat(self, ids: np.ndarray) -> np.ndarray:
        """uint8 [sum of lengths]: the bytes of ``ids`` [n] back to back (one gather from the table)."""
        lengths = self.lengths[ids]
        total = int(lengths.sum())
        starts = np.cumsum(lengths) - lengths                                 # where each token's bytes go
        index = np.arange(total, dtype=np.int64) + np.repeat(self.offsets[ids] - starts, lengths)
        return self.bytes[index]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text; ``encode_batch_fast`` (no character offsets: ~1.5x less CPU than ``encode``)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def check_lossless(table: TokenBytes, texts, *, what: str = "tokenizer") -> None:
    """ValueError naming the first text and byte where ``table``'s tokens do not concatenate to the text (one
    leading space a SentencePiece tokenizer prepends is allowed: ``align.student_spans`` drops it)."""
    for number, text in enumerate(texts):
        ids = table.encode(text)
        got, want = b"".join(table.strings[i] for i in ids), text.encode()
        if got != want and got != b" " + want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise ValueError(f"{what} {table.identity!r} is not lossless on text {number}: its tokens give "
                             f"{got[max(0, at - 10):at + 10]!r} where the text holds {want[max(0, at - 10):at + 10]!r}"
                             f" (byte {at}); cross-tokenizer distillation needs tokens that concatenate to the text")
