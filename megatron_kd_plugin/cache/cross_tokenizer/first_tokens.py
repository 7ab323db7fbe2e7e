"""The student's first token of every teacher token's string and of each of its suffixes, computed once per pair of
tokenizers: how the token-level term reads a teacher candidate as the student's next token (issue #31; the
definition is ``loss.cross_tokenizer_loss``'s).

Teacher token v stands for the bytes s_v (``token_bytes``). For o = 0..len(s_v), entry (v, o) sits at index
base[v] + o (base[v] = offsets[v] + v: len(s_v) + 1 entries per token) of two int32 arrays:

    node   an id of the byte string s_v[:o]: two entries hold one id iff their prefixes are the same bytes (the
           student, having read o bytes of a teacher token, can only be continued by candidates of its prefix)
    first  the student's first token of s_v[o:] for o < len(s_v); -1 at o = len(s_v) and where there is none

The student's first token of a byte string u is context-free: u read as if it began at a token boundary of the text.
    u begins with a whole UTF-8 character: the first token of the student's mid-text encode of u's longest valid
        UTF-8 prefix (``mid_text_tokenizer``: the tokenizer without the space a SentencePiece-style tokenizer
        prepends to a text), kept if its string is a prefix of u; else -1 (an ``<unk>``, a normalised character);
    u begins inside a character (a byte-level token's tail, a ``<0xNN>`` piece): the student token whose string is
        the longest prefix of u (a byte-level or byte-fallback token), -1 if none.
A special (added) token is its content, as the rows' text holds it: a teacher's special token reaches the student's
special token of the same content (its tokenizer splits it out of the text), or the first token of that text.
Where the student's tokenization of u depends on what follows u (a merge across u's end) the table is an
approximation; ``demo --student-tokenizer`` measures how often it differs from the student's own tokens.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes


def _mid_text_spec(spec: dict | None) -> dict | None:
    """A normalizer / pre-tokenizer spec without the space it prepends to a text (Metaspace's prepend scheme,
    ByteLevel's add_prefix_space, a ``Prepend`` normalizer)."""
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        key = "normalizers" if "normalizers" in spec else "pretokenizers"
        items = [_mid_text_spec(item) for item in spec[key]]
        return dict(spec, **{key: [item for item in items if item is not None]})
    if kind == "Prepend":
        return None
    if kind == "Metaspace":
        return dict(spec, prepend_scheme="never", **({"add_prefix_space": False} if "add_prefix_space" in spec else {}))
    if kind == "ByteLevel" and spec.get("add_prefix_space"):
        return dict(spec, add_prefix_space=False)
    return spec


def mid_text_tokenizer(tokenizer):
    """A copy of a ``tokenizers.Tokenizer`` that encodes a text as it would the same characters in the middle of a
    document: no space prepended (``_mid_text_spec``)."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    spec["normalizer"] = _mid_text_spec(spec.get("normalizer"))
    spec["pre_tokenizer"] = _mid_text_spec(spec.get("pre_tokenizer"))
    return Tokenizer.from_str(json.dumps(spec))


def _valid_prefix(u: bytes) -> str:
    """The longest valid UTF-8 prefix of ``u``, decoded."""
    try:
        return u.decode("utf-8")
    except UnicodeDecodeError as error:
        return u[:error.start].decode("utf-8")


def student_first_tokens(strings: list[bytes], student: TokenBytes) -> np.ndarray:
    """int32 [len(strings)]: the student's first token of each byte string (module docstring), -1 where none."""
    encoder = mid_text_tokenizer(student.tokenizer)
    by_string: dict[bytes, int] = {}
    for student_id, string in enumerate(student.strings):
        if string:
            by_string.setdefault(string, student_id)
    longest = max((len(s) for s in by_string), default=0)
    out = np.full(len(strings), -1, dtype=np.int32)
    texts = [_valid_prefix(u) for u in strings]
    encoded = [i for i, text in enumerate(texts) if text]
    batch = 4096
    for start in range(0, len(encoded), batch):
        block = encoded[start:start + batch]
        for i, encoding in zip(block, encoder.encode_batch_fast([texts[i] for i in block], add_special_tokens=False)):
            if encoding.ids:
                first = encoding.ids[0]
                piece = student.strings[first] if first < len(student.strings) else b""
                if piece and strings[i].startswith(piece):
                    out[i] = first
    for i, text in enumerate(texts):
        if not text and strings[i]:                                        # u begins inside a character
            u = strings[i]
            out[i] = next((by_string[u[:n]] for n in range(min(len(u), longest), 0, -1) if u[:n] in by_string), -1)
    return out


@dataclasses.dataclass(frozen=True)
class FirstTokens:
    """The table of a teacher and a student tokenizer (module docstring)."""

    base: np.ndarray
    """int64 [V + 1]: token v's entries are base[v] .. base[v] + len(s_v)."""
    node: np.ndarray
    """int32 [base[V]]: an id of the prefix s_v[:o]."""
    first: np.ndarray
    """int32 [base[V]]: the student's first token of s_v[o:], -1 where none."""

    @classmethod
    def compute(cls, teacher: TokenBytes, student: TokenBytes) -> "FirstTokens":
        """The table of ``teacher`` (a byte table) and ``student`` (a ``TokenBytes`` with its tokenizer)."""
        if student.tokenizer is None:
            raise ValueError(f"the student's first tokens need its tokenizer; {student.identity!r} is a byte table")
        lengths = teacher.lengths
        base = np.concatenate([[0], np.cumsum(lengths + 1)]).astype(np.int64)
        node = np.empty(int(base[-1]), dtype=np.int32)
        prefixes: dict[bytes, int] = {}
        suffix_ids: dict[bytes, int] = {}
        suffix_of = np.full(int(base[-1]), -1, dtype=np.int64)
        for v, string in enumerate(teacher.strings):
            start = int(base[v])
            for o in range(len(string) + 1):
                node[start + o] = prefixes.setdefault(string[:o], len(prefixes))
                if o < len(string):
                    suffix_of[start + o] = suffix_ids.setdefault(string[o:], len(suffix_ids))
        firsts = student_first_tokens(list(suffix_ids), student)
        first = np.where(suffix_of >= 0, firsts[np.maximum(suffix_of, 0)], -1).astype(np.int32)
        return cls(base, node, first)

    @property
    def vocab_map(self) -> np.ndarray:
        """int32 [V]: the student's first token of each teacher token's string (o = 0), -1 where none."""
        return self.first[self.base[:-1]]
