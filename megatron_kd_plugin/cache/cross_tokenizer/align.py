"""A student row with its own tokenizer from a cached teacher sample: re-tokenise, align, cut (issue #18).

A cached sample holds S + 1 teacher tokens and, for t = 0..S-1, the teacher's log-prob of token t + 1 given tokens
0..t (``teacher_realised_logprob``). Its text X is the concatenation of the tokens' bytes (``token_bytes``); teacher
token i ends at byte e_i = sum_{i' <= i} len(token i'). The window may start or end inside a UTF-8 character (it is
cut from a token stream): the student reads X[u:w], the longest valid UTF-8 text after at most 3 leading
continuation bytes. The student tokenises it into n tokens; student token j ends at byte b_j (offset u added).

Segments (the finest common segmentation): the common boundaries B = {e_i} ∩ {b_j}, sorted B_0 < B_1 < ...; segment
k >= 1 is the bytes (B_{k-1}, B_k]. A token (either side) with end e lies in segment k(e) = the least k with B_k >= e.
Segment 0 holds token 0 of both sides, whose log-probs no model gives (nothing precedes them): it is not used, so
every token of a used segment has its log-prob on both sides. Per used segment the teacher's log-likelihood is
t_k = sum of teacher_realised_logprob[i - 1] over the teacher tokens i in it.

Cut: the row holds at most seq_length + 1 student tokens. With more, it ends at the last boundary B_K whose student
token j_K <= seq_length: tokens 0..j_K are kept, segments 1..K used, nothing after B_K (never mid-segment). Student
tokens after the last common boundary (a window's ragged end) are dropped too. With no common boundary within
reach the row holds the first seq_length + 1 tokens with no segment (CE only).

Row (a ``kd_rows.KDRow``; student positions p = 0..seq_length-1; position p predicts token p + 1; m = the kept tokens
- 1): tokens [S_s] ids 0..m-1 (0-padded), labels [S_s] ids 1..m (0-padded), loss_mask [S_s] 1 for p < m, and the
teacher, a ``CrossTokenizerTeacher``:
    segment_ids [S_s] int64: k(b_{p+1}) - 1 for used segments, else -1,
    segment_logprobs [S_s] float32: entry c = t_{c+1} for c < K, else 0.

Token-level term (``token_slots``: its per-sample part; the definition is ``loss.cross_tokenizer_loss``'s): with a
top-K store the row holds the sample's candidates once per cache position, the top-K mapped to the student's first
tokens and the realised token, and per student position where to read them (a boundary position) or its own
candidates (inside a teacher token):
    token_positions [S_s] int64: t_p at a boundary position p (o_p = 0), -1 elsewhere,
    token_ids [S, K] int32: ``first_tokens.vocab_map`` of the cached top-K ids (-1: none),
    token_logprobs [S, K]: the cached log-probs (as read: the store's dtype),
    realised_logprobs [S]: ``teacher_realised_logprob`` (as read), the realised token's candidate where the top-K
        lacks it (slot K),
    realised_slots [S] int64: r_t (K: not in the top-K; the loss puts the student's label there),
    mid_ids [S_s, J] int32, mid_logprobs [S_s, J] float32: inside a teacher token the position's candidates (-1, -inf:
        none), J = min(``token_slots.MID_CANDIDATES``, K + 1);
K = J = 0 for a store without a top-K.

Two steps: ``align_sample`` (the encode, the segment indices k(b_j), k(e_i) and, with the top-K, the token slots: no
seq_length; what ``student_alignments`` keeps per sample) and ``alignment_row`` (the cut and the row).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_kd_plugin.cache.cross_tokenizer.first_tokens import FirstTokens
from megatron_kd_plugin.cache.rows.kd_rows import KDRow
from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes
from megatron_kd_plugin.cache.cross_tokenizer.token_slots import MID_CANDIDATES, TokenSlots, token_slots
from megatron_kd_plugin.loss import CrossTokenizerTeacher


@dataclasses.dataclass(frozen=True)
class TeacherTopK:
    """A cached sample's teacher side for the token-level term: top-K ``ids`` and ``logprobs`` [S, K] and the
    ``realised`` log-probs [S] (``teacher_realised_logprob``)."""

    ids: np.ndarray
    logprobs: np.ndarray
    realised: np.ndarray


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
    """One cached sample re-tokenised by the student and cut into segments, for any seq_length (module docstring;
    segment indices are 0-based indices k into B: a token with end e lies in segment k(e); k = num_boundaries for the
    tokens after the last common boundary). What a reader keeps per sample: ~4.5 B per student token plus 4 per
    teacher token, and with the token slots ~5 B per student token, 8 per candidate inside a teacher token and 2 per
    teacher token."""

    ids: np.ndarray
    """int32 [n]: the student's ids of the sample's text."""
    student_segments: np.ndarray
    """int32 [n]: k(b_j), non-decreasing."""
    teacher_segments: np.ndarray
    """int32 [S]: k(e_i) of teacher tokens i = 1..S (the tokens with a realised log-prob)."""
    num_boundaries: int
    """|B|."""
    slots: TokenSlots | None = None
    """The token-level term's slots (``token_slots``), for a store with a top-K."""


def byte_ends(tokens: np.ndarray, teacher: TokenBytes, student: TokenBytes, *, ids: np.ndarray | None = None,
              where: str = "sample") -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(e_i [S + 1] of teacher ``tokens`` [S + 1], the student's ids [n] of their text, b_j [n], u) (module docstring);
    ``ids``: the student's encoding of the text (``valid_text``) when already known (a batch encode), else encoded
    here; ``where`` names the sample in errors."""
    tokens = np.asarray(tokens, dtype=np.int64)
    teacher_ends = np.cumsum(teacher.lengths[tokens])                                  # [S + 1] e_i
    u, chars = valid_text(teacher.concat(tokens).tobytes())
    ids = np.asarray(student.encode(chars) if ids is None else ids, dtype=np.int64)
    return teacher_ends, ids, student_ends(student, ids, chars, where) + u, u           # [n] b_j


def align_sample(tokens: np.ndarray, teacher: TokenBytes, student: TokenBytes, *, ids: np.ndarray | None = None,
                 where: str = "sample", topk: TeacherTopK | None = None,
                 table: FirstTokens | None = None) -> SampleAlignment:
    """The alignment of one cached sample's teacher ``tokens`` [S + 1] (``ids``, ``where``: ``byte_ends``'); with
    ``topk`` (and the tokenizers' ``FirstTokens`` ``table``) the token slots too."""
    tokens = np.asarray(tokens, dtype=np.int64)
    teacher_ends, ids, ends, u = byte_ends(tokens, teacher, student, ids=ids, where=where)
    is_teacher_end = np.zeros(int(teacher_ends[-1]) + 1 if len(tokens) else 1, dtype=bool)
    is_teacher_end[teacher_ends] = True
    common = ends[is_teacher_end[ends]]                                                # B, sorted
    common = common[(common > u) & np.append(common[1:] != common[:-1], True)]         # unique
    slots = None if topk is None else token_slots(tokens, teacher_ends, ids, ends, topk.ids, topk.logprobs,
                                                  topk.realised, teacher, table)
    return SampleAlignment(ids.astype(np.int32), np.searchsorted(common, ends, side="left").astype(np.int32),
                           np.searchsorted(common, teacher_ends[1:], side="left").astype(np.int32), len(common), slots)


def alignment_row(alignment: SampleAlignment, realised_logprobs: np.ndarray, seq_length: int,
                  topk: TeacherTopK | None = None, vocab_map: np.ndarray | None = None) -> KDRow:
    """The student row (module docstring) of an aligned sample and its ``realised_logprobs`` [S]; with ``topk`` (the
    alignment then has its token slots) and the ``vocab_map`` [V_teacher] the token-level term's arrays too (else
    K + 1 = J = 0)."""
    ids, student_k = alignment.ids, alignment.student_segments
    # the cut: K = the last boundary whose student token index is <= seq_length
    token_at = np.searchsorted(student_k, np.arange(alignment.num_boundaries), side="right") - 1   # token ending at B_k
    last = int(np.searchsorted(token_at, seq_length, side="right")) - 1                         # K
    m = max(int(token_at[last]) if last >= 0 else min(len(ids) - 1, seq_length), 0)
    row_segments = np.full(seq_length, -1, dtype=np.int64)
    segment_logprobs = np.zeros(seq_length, dtype=np.float64)
    if last >= 1:
        labels_k = student_k[1:m + 1]                                                  # segment of tokens 1..m
        row_segments[:m] = np.where((labels_k >= 1) & (labels_k <= last), labels_k - 1, -1)
        teacher_k = alignment.teacher_segments
        used = (teacher_k >= 1) & (teacher_k <= last)
        np.add.at(segment_logprobs, teacher_k[used] - 1, np.asarray(realised_logprobs, dtype=np.float64)[used])
    row_tokens = np.zeros(seq_length, dtype=np.int64)
    labels = np.zeros(seq_length, dtype=np.int64)
    row_tokens[:m], labels[:m] = ids[:m], ids[1:m + 1]
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    loss_mask[:m] = 1.0
    token_arrays = _token_arrays(alignment.slots, topk, vocab_map, realised_logprobs, m, seq_length)
    teacher = CrossTokenizerTeacher(torch.from_numpy(row_segments),
                                    torch.from_numpy(segment_logprobs.astype(np.float32)),
                                    *(torch.from_numpy(array) for array in token_arrays))
    return KDRow(torch.from_numpy(row_tokens), torch.from_numpy(labels), torch.from_numpy(loss_mask),
                 torch.arange(seq_length, dtype=torch.long), teacher)


def _token_arrays(slots: TokenSlots | None, topk: TeacherTopK | None, vocab_map: np.ndarray | None,
                  realised_logprobs: np.ndarray, m: int, seq_length: int) -> tuple[np.ndarray, ...]:
    """(token_positions [S_s], token_ids, token_logprobs [S, K], realised_logprobs, realised_slots [S], mid_ids,
    mid_logprobs [S_s, J]) of the row's first ``m`` positions (module docstring)."""
    num_cached = len(realised_logprobs)
    positions = np.full(seq_length, -1, dtype=np.int64)
    if topk is None:
        return (positions, np.zeros((num_cached, 0), np.int32), np.zeros((num_cached, 0), np.float32),
                realised_logprobs, np.zeros(num_cached, np.int64), np.zeros((seq_length, 0), np.int32),
                np.zeros((seq_length, 0), np.float32))
    k = topk.ids.shape[1]
    token_ids = np.take(vocab_map, topk.ids, mode="clip")                               # [S, K]
    counts = slots.mid_counts[:m]
    positions[:m] = np.where(counts == 0, slots.sources[:m], -1)
    width = min(MID_CANDIDATES, k + 1)
    mid_ids = np.full((seq_length, width), -1, dtype=np.int32)
    mid_logprobs = np.full((seq_length, width), -np.inf, dtype=np.float32)
    total = int(counts.sum(dtype=np.int64))
    if total:
        rows = np.repeat(np.arange(m), counts)
        columns = np.arange(total) - np.repeat(np.cumsum(counts, dtype=np.int64) - counts, counts)
        mid_ids[rows, columns] = slots.mid_ids[:total]
        mid_logprobs[rows, columns] = slots.mid_logprobs[:total]
    return (positions, token_ids, topk.logprobs, realised_logprobs, slots.realised.astype(np.int64), mid_ids,
            mid_logprobs)
