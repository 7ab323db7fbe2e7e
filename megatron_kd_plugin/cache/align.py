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

Row (a ``rows.KDRow``; student positions p = 0..seq_length-1; position p predicts token p + 1; m = the kept tokens
- 1): tokens [S_s] ids 0..m-1 (0-padded), labels [S_s] ids 1..m (0-padded), loss_mask [S_s] 1 for p < m, and the
teacher, a ``CrossTokenizerTeacher``:
    segment_ids [S_s] int64: k(b_{p+1}) - 1 for used segments, else -1,
    segment_logprobs [S_s] float32: entry c = t_{c+1} for c < K, else 0.

Pairs (the token-level term's positions): a used segment k made of one teacher token i and one student token j of
the same string (``identical_strings``: the student id of each teacher token's string) pairs row position p = j - 1
with cache position i - 1 (the distribution the teacher predicted token i from, after the same bytes the student
read before token j). The teacher holds the sample's top-K once, mapped to the student's ids of identical strings,
and each position's pair (the loss expands them to [S_s, K] on the model's device: ``loss.cross_tokenizer_loss``):
    pair_positions [S_s] int64: i - 1 at a pair position p, -1 elsewhere,
    pair_ids [S, K] int32: vocab_map[cached ids] (0 where unmapped),
    pair_logprobs [S, K] float32: the cached log-probs, -inf where unmapped (K = 0 for a store without a top-K).

Two steps: ``align_sample`` (the encode and the segment indices k(b_j), k(e_i): no seq_length, no log-probs; what
``student_alignments`` keeps per sample) and ``alignment_row`` (the cut and the row).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_kd_plugin.cache.rows import KDRow
from megatron_kd_plugin.cache.token_bytes import TokenBytes
from megatron_kd_plugin.loss import CrossTokenizerTeacher


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
    """One cached sample re-tokenised by the student and cut into segments, for any seq_length (module docstring;
    segment indices are 0-based indices k into B: a token with end e lies in segment k(e); k = num_boundaries for the
    tokens after the last common boundary). What a reader keeps per sample: ~4.5 B per student token plus 4 per
    teacher token."""

    ids: np.ndarray
    """int32 [n]: the student's ids of the sample's text."""
    student_segments: np.ndarray
    """int32 [n]: k(b_j), non-decreasing."""
    teacher_segments: np.ndarray
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
                  topk: TeacherTopK | None = None) -> KDRow:
    """The student row (module docstring) of an aligned sample and its ``realised_logprobs`` [S]; with ``topk`` the
    pairs' top-K too (else K = 0)."""
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
    if topk is not None:
        positions, pair_ids, pair_logprobs = _pair_arrays(alignment, topk, last, seq_length)
    else:
        positions = torch.full((seq_length,), -1, dtype=torch.int64)
        pair_ids = torch.zeros(len(realised_logprobs), 0, dtype=torch.int32)
        pair_logprobs = torch.zeros(len(realised_logprobs), 0, dtype=torch.float32)
    teacher = CrossTokenizerTeacher(torch.from_numpy(row_segments),
                                    torch.from_numpy(segment_logprobs.astype(np.float32)), positions, pair_ids,
                                    pair_logprobs)
    return KDRow(torch.from_numpy(row_tokens), torch.from_numpy(labels), torch.from_numpy(loss_mask),
                 torch.arange(seq_length, dtype=torch.long), teacher)


def _pair_arrays(alignment: SampleAlignment, topk: TeacherTopK, last: int,
                 seq_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair_positions [S_s], pair_ids [S, K], pair_logprobs [S, K]) (module docstring) of the used segments
    1..``last``."""
    segments = np.arange(1, max(last, 0) + 1)
    student_k, teacher_k = alignment.student_segments, alignment.teacher_segments
    first_student = np.searchsorted(student_k, segments, side="left")                # j_k
    first_teacher = np.searchsorted(teacher_k, segments, side="left")                # i_k - 1 (teacher_k: tokens 1..S)
    single = (np.searchsorted(student_k, segments, side="right") - first_student == 1) & \
        (np.searchsorted(teacher_k, segments, side="right") - first_teacher == 1)
    student_ids = alignment.ids[np.minimum(first_student, len(alignment.ids) - 1)]
    teacher_ids = topk.tokens[np.minimum(first_teacher + 1, len(topk.tokens) - 1)]
    pairs = single & (topk.vocab_map[teacher_ids] == student_ids)
    positions = np.full(seq_length, -1, dtype=np.int64)
    positions[first_student[pairs] - 1] = first_teacher[pairs]                     # p = j - 1 -> i - 1
    mapped = topk.vocab_map.take(topk.ids)                                         # [S, K] int32
    logprobs = topk.logprobs.astype(np.float32)                                    # a copy
    np.copyto(logprobs, -np.inf, where=mapped < 0)
    np.maximum(mapped, 0, out=mapped)
    return torch.from_numpy(positions), torch.from_numpy(mapped), torch.from_numpy(logprobs)
