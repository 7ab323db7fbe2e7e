"""A student row with its own tokenizer from a cached teacher sample: re-tokenise, align, cut (issue #18).

A cached sample holds S + 1 teacher tokens and, for t = 0..S-1, the teacher's log-prob of token t + 1 given tokens
0..t (``teacher_realised_logprob``). Its text X is the concatenation of the tokens' bytes (``token_bytes``); teacher
token i ends at byte e_i = sum_{i' <= i} len(token i'). The window may start or end inside a UTF-8 character (it is
cut from a token stream): the student reads X[u:w], the longest valid UTF-8 text after at most 3 leading
continuation bytes. The student tokenises it into n tokens; student token j ends at byte b_j (offset u added).

Chunks (the finest common segmentation): the common boundaries B = {e_i} ∩ {b_j}, sorted B_0 < B_1 < ...; chunk
k >= 1 is the bytes (B_{k-1}, B_k]. A token (either side) with end e lies in chunk k(e) = the least k with B_k >= e.
Chunk 0 holds token 0 of both sides, whose log-probs no model gives (nothing precedes them): it is not used, so
every token of a used chunk has its log-prob on both sides. Per used chunk the teacher's log-likelihood is
t_k = sum of teacher_realised_logprob[i - 1] over the teacher tokens i in it.

Cut: the row holds at most seq_length + 1 student tokens. With more, it ends at the last boundary B_K whose student
token j_K <= seq_length: tokens 0..j_K are kept, chunks 1..K used, nothing after B_K (never mid-chunk). Student
tokens after the last common boundary (a window's ragged end) are dropped too. With no common boundary within
reach the row holds the first seq_length + 1 tokens with no chunk (CE only).

Row (student positions p = 0..seq_length-1; position p predicts token p + 1; m = the kept tokens - 1):
    tokens [S_s] ids 0..m-1 (0-padded), labels [S_s] ids 1..m (0-padded), loss_mask [S_s] 1 for p < m,
    chunk_ids [S_s] int64: k(b_{p+1}) - 1 for used chunks, else -1,
    teacher_chunk_logprobs [S_s] float32: entry c = t_{c+1} for c < K, else 0.

Pairs (the token-level term's positions): a used chunk k made of one teacher token i and one student token j of
the same string (``identical_strings``: the student id of each teacher token's string) pairs row position p = j - 1
with cache position i - 1 (the distribution the teacher predicted token i from, after the same bytes the student
read before token j). The row holds the sample's top-K once, mapped to the student's ids of identical strings, and
each position's pair (``pair_topk`` expands them to [S_s, K] on the model's device):
    pair_positions [S_s] int64: i - 1 at a pair position p, -1 elsewhere,
    pair_teacher_ids [S, K] int32: vocab_map[cached ids] (0 where unmapped),
    pair_teacher_logprobs [S, K] float32: the cached log-probs, -inf where unmapped.

Two steps: ``align_sample`` (the encode and the chunk indices k(b_j), k(e_i): no seq_length, no log-probs; what
``student_alignments`` keeps per sample) and ``alignment_row`` (the cut and the row); ``cross_tokenizer_row`` is both.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_kd_plugin.cache.token_bytes import TokenBytes

CHUNK_IDS, CHUNK_LOGPROBS = "chunk_ids", "teacher_chunk_logprobs"
PAIR_POSITIONS, PAIR_IDS, PAIR_LOGPROBS = "pair_positions", "pair_teacher_ids", "pair_teacher_logprobs"
PAIR_KEYS = (PAIR_POSITIONS, PAIR_IDS, PAIR_LOGPROBS)
"""A cross-tokenizer row's pair arrays (module docstring)."""


def identical_strings(teacher: TokenBytes, student: TokenBytes) -> np.ndarray:
    """int32 [V_teacher]: the student id whose string equals teacher id v's (the lowest such id), -1 where none or
    where v's string is empty (ids the tokenizer lacks)."""
    ids = {}
    for student_id, string in enumerate(student.strings):
        if string:
            ids.setdefault(string, student_id)
    return np.fromiter((ids.get(string, -1) if string else -1 for string in teacher.strings), dtype=np.int32,
                       count=len(teacher.strings))


@dataclasses.dataclass(frozen=True)
class TeacherTopK:
    """A cached sample's teacher side for the pairs: its ``tokens`` [S + 1], top-K ``ids`` and ``logprobs`` [S, K],
    and the ``vocab_map`` of ``identical_strings``."""

    tokens: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray
    vocab_map: np.ndarray


def valid_text(text: bytes) -> tuple[int, str]:
    """(u, the longest valid UTF-8 text starting at u): u skips at most 3 leading continuation bytes."""
    u = 0
    while u < min(3, len(text)) and 0x80 <= text[u] < 0xC0:
        u += 1
    try:
        return u, text[u:].decode("utf-8")
    except UnicodeDecodeError as exc:
        return u, text[u:u + exc.start].decode("utf-8")


def student_ends(student: TokenBytes, ids: np.ndarray, text: str, where: str) -> np.ndarray:
    """int64 [n] byte ends of ``ids`` within ``text``'s UTF-8; ValueError if they do not concatenate to it. A space
    a SentencePiece-style tokenizer prepends to a piece (at the start, and after each special token) that the text
    does not hold is dropped from that token."""
    want = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths, at = _drop_prefix_spaces(student, ids, want)
    if at is not None:
        raise ValueError(f"{where}: the student tokenizer {student.identity!r} and the text disagree at byte "
                         f"{at}: its tokens give {student.concat(ids).tobytes()[max(0, at - 12):at + 12]!r}, the "
                         f"teacher's text {want[max(0, at - 12):at + 12].tobytes()!r} (an unalignable byte span: "
                         "the student tokenizer normalises or drops characters, or has no token for them)")
    return np.cumsum(lengths)


def _drop_prefix_spaces(student: TokenBytes, ids: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, int | None]:
    """(token lengths with inserted leading spaces removed, None) or (-, the first byte of ``want`` no token
    matches). Token by token: a piece that matches the text where it stands is kept; one that does not, starts with
    a space and matches without it loses the space; any other is a mismatch. Vectorised: the tokens before the first
    differing byte all match as they are, so only the token holding that byte is looked at, once per dropped space.
    """
    lengths = student.lengths[ids].copy()                                          # [n]
    got, text = student.concat(ids), want.tobytes()
    while True:
        common = min(len(got), len(want))
        differ = np.flatnonzero(got[:common] != want[:common])
        if differ.size == 0 and len(got) <= len(want):
            return lengths, None if len(got) == len(want) else len(got)
        first = int(differ[0]) if differ.size else common                          # got runs past the text
        ends = np.cumsum(lengths)
        j = int(np.searchsorted(ends, first, side="right"))                        # the token holding that byte
        start = int(ends[j] - lengths[j])
        piece = student.strings[int(ids[j])]
        if piece[:1] != b" " or not text.startswith(piece[1:], start):
            return lengths, start
        lengths[j] -= 1
        got = np.delete(got, start)


@dataclasses.dataclass(frozen=True)
class SampleAlignment:
    """One cached sample re-tokenised by the student and cut into chunks, for any seq_length (module docstring;
    chunk indices are 0-based indices k into B: a token with end e lies in chunk k(e); k = num_boundaries for the
    tokens after the last common boundary). What a reader keeps per sample: ~4.5 B per student token plus 4 per
    teacher token."""

    ids: np.ndarray
    """int32 [n]: the student's ids of the sample's text."""
    student_chunks: np.ndarray
    """int32 [n]: k(b_j), non-decreasing."""
    teacher_chunks: np.ndarray
    """int32 [S]: k(e_i) of teacher tokens i = 1..S (the tokens with a realised log-prob)."""
    num_boundaries: int
    """|B|."""


def align_sample(tokens: np.ndarray, teacher: TokenBytes, student: TokenBytes, *, ids: np.ndarray | None = None,
                 where: str = "sample") -> SampleAlignment:
    """The alignment of one cached sample's teacher ``tokens`` [S + 1]; ``ids``: the student's encoding of its text
    (``valid_text``) when already known (a batch encode), else encoded here; ``where`` names the sample in errors."""
    tokens = np.asarray(tokens, dtype=np.int64)
    teacher_ends = np.cumsum(teacher.lengths[tokens])                                  # [S + 1] e_i
    u, chars = valid_text(teacher.concat(tokens).tobytes())
    ids = np.asarray(student.encode(chars) if ids is None else ids, dtype=np.int64)
    ends = student_ends(student, ids, chars, where) + u                                # [n] b_j
    is_teacher_end = np.zeros(int(teacher_ends[-1]) + 1 if len(tokens) else 1, dtype=bool)
    is_teacher_end[teacher_ends] = True
    common = ends[is_teacher_end[ends]]                                                # B, sorted
    common = common[(common > u) & np.append(common[1:] != common[:-1], True)]         # unique
    return SampleAlignment(ids.astype(np.int32), np.searchsorted(common, ends, side="left").astype(np.int32),
                           np.searchsorted(common, teacher_ends[1:], side="left").astype(np.int32), len(common))


def alignment_row(alignment: SampleAlignment, realised_logprobs: np.ndarray, seq_length: int,
                  topk: TeacherTopK | None = None) -> dict[str, torch.Tensor]:
    """The student row (module docstring) of an aligned sample and its ``realised_logprobs`` [S]; with ``topk`` the
    pair arrays too."""
    ids, student_k = alignment.ids, alignment.student_chunks
    # the cut: K = the last boundary whose student token index is <= seq_length
    token_at = np.searchsorted(student_k, np.arange(alignment.num_boundaries), side="right") - 1   # token ending at B_k
    last = int(np.searchsorted(token_at, seq_length, side="right")) - 1                         # K
    m = max(int(token_at[last]) if last >= 0 else min(len(ids) - 1, seq_length), 0)
    row_chunks = np.full(seq_length, -1, dtype=np.int64)
    chunk_logprobs = np.zeros(seq_length, dtype=np.float64)
    if last >= 1:
        labels_k = student_k[1:m + 1]                                                  # chunk of tokens 1..m
        row_chunks[:m] = np.where((labels_k >= 1) & (labels_k <= last), labels_k - 1, -1)
        teacher_k = alignment.teacher_chunks
        used = (teacher_k >= 1) & (teacher_k <= last)
        np.add.at(chunk_logprobs, teacher_k[used] - 1, np.asarray(realised_logprobs, dtype=np.float64)[used])
    row_tokens = np.zeros(seq_length, dtype=np.int64)
    labels = np.zeros(seq_length, dtype=np.int64)
    row_tokens[:m], labels[:m] = ids[:m], ids[1:m + 1]
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    loss_mask[:m] = 1.0
    row = {"tokens": torch.from_numpy(row_tokens), "labels": torch.from_numpy(labels),
           "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.arange(seq_length, dtype=torch.long),
           CHUNK_IDS: torch.from_numpy(row_chunks),
           CHUNK_LOGPROBS: torch.from_numpy(chunk_logprobs.astype(np.float32))}
    if topk is not None:
        row.update(_pair_arrays(alignment, topk, last, seq_length))
    return row


def _pair_arrays(alignment: SampleAlignment, topk: TeacherTopK, last: int,
                 seq_length: int) -> dict[str, torch.Tensor]:
    """The pair arrays (module docstring) of the used chunks 1..``last``."""
    chunks = np.arange(1, max(last, 0) + 1)
    student_k, teacher_k = alignment.student_chunks, alignment.teacher_chunks
    first_student = np.searchsorted(student_k, chunks, side="left")                # j_k
    first_teacher = np.searchsorted(teacher_k, chunks, side="left")                # i_k - 1 (teacher_k: tokens 1..S)
    single = (np.searchsorted(student_k, chunks, side="right") - first_student == 1) & \
        (np.searchsorted(teacher_k, chunks, side="right") - first_teacher == 1)
    student_ids = alignment.ids[np.minimum(first_student, len(alignment.ids) - 1)]
    teacher_ids = topk.tokens[np.minimum(first_teacher + 1, len(topk.tokens) - 1)]
    pairs = single & (topk.vocab_map[teacher_ids] == student_ids)
    positions = np.full(seq_length, -1, dtype=np.int64)
    positions[first_student[pairs] - 1] = first_teacher[pairs]                     # p = j - 1 -> i - 1
    mapped = topk.vocab_map.take(topk.ids)                                         # [S, K] int32
    logprobs = topk.logprobs.astype(np.float32)                                    # a copy
    np.copyto(logprobs, -np.inf, where=mapped < 0)
    np.maximum(mapped, 0, out=mapped)
    return {PAIR_POSITIONS: torch.from_numpy(positions), PAIR_IDS: torch.from_numpy(mapped),
            PAIR_LOGPROBS: torch.from_numpy(logprobs)}


def pair_topk(positions: torch.Tensor, ids: torch.Tensor,
              logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each student position's pair, expanded: ``pair_positions`` [b, S_s], ``pair_teacher_ids`` /
    ``pair_teacher_logprobs`` [b, S, K] -> (teacher_ids, teacher_logprobs) [b, S_s, K] in the student's ids, -inf
    (and id 0) at the positions without a pair (what ``loss.cross_tokenizer`` takes, transposed to [s, b, K])."""
    index = positions.clamp(min=0)[..., None].expand(-1, -1, ids.shape[-1])         # [b, S_s, K]
    none = (positions < 0)[..., None]
    return (ids.gather(1, index).masked_fill(none, 0),
            logprobs.gather(1, index).masked_fill(none, -torch.inf))


def cross_tokenizer_row(tokens: np.ndarray, realised_logprobs: np.ndarray, teacher: TokenBytes, student: TokenBytes,
                        seq_length: int, *, topk: tuple[np.ndarray, np.ndarray] | None = None,
                        where: str = "sample") -> dict[str, torch.Tensor]:
    """The student row of one cached sample (module docstring): teacher ``tokens`` [S + 1] ids,
    ``realised_logprobs`` [S]; ``topk``: the cached (ids, logprobs) [S, K] for the pair arrays; ``where`` names the
    sample in errors."""
    pairs = None if topk is None else TeacherTopK(np.asarray(tokens, dtype=np.int64), np.asarray(topk[0]),
                                                  np.asarray(topk[1]), identical_strings(teacher, student))
    return alignment_row(align_sample(tokens, teacher, student, where=where), realised_logprobs, seq_length, pairs)
