"""The token-level term's teacher slots of one cached sample at the student's positions (issue #31): the host part of
``loss.cross_tokenizer_loss``'s definition, computed once per sample with its alignment (``align.align_sample``).

Cached sample: teacher tokens x_0..x_S, token i ending at byte e_i; at cache position t the top-K (I_k, l_k), k < K,
is the teacher's distribution over x_{t+1}, and ``teacher_realised_logprob`` [t] the log-prob of x_{t+1} itself. The
student's tokens of the same text end at bytes b_j; student position j (it has read the text up to b_j) predicts
student token j + 1. Its teacher is read at

    t_j = the last teacher token ending at or before b_j (e_{t_j} <= b_j < e_{t_j + 1}),  o_j = b_j - e_{t_j}

The candidates at t are the K + 1 slots: the top-K and, as slot K, the realised token x_{t+1} with its realised
log-prob unless the top-K holds it (then slot K is empty); r_t = the realised token's slot.

    sources      int32 [n]   t_j, -1 where b_j < e_0, j = n - 1 (no label) or inside a token no candidate is kept
    realised     int16 [S]   r_t
    mid_counts   uint8 [n]   0 at a boundary position (o_j = 0); inside teacher token t_j + 1 (o_j > 0): the number
                             of its candidates kept (>= 1)
    mid_ids      int32 [E]   inside a token, the kept candidates of the positions back to back (in position order,
    mid_logprobs float32 [E] most probable first): the student id each reaches and its log-prob given the prefix

Inside a teacher token the student has read pi = the first o_j bytes of x_{t_j + 1}. A candidate v is consistent when
its string starts with pi (``first_tokens``' prefix ids); Z_j = sum of the consistent candidates' probabilities (the
teacher's probability, as far as the slots know it, that its next token starts with pi). A consistent v with
len(s_v) > o_j reaches the student's first token of s_v[o_j:] (``first_tokens``), the realised one the student's own
next token y_j; it is kept with log-prob l_v - log Z_j, at most ``MID_CANDIDATES`` per position (the realised one and
the most probable others); a consistent one reaching no student token (len(s_v) = o_j, or no first token) keeps its
mass in Z_j only (the ghost bucket). Boundary positions need nothing per position: the loss reads the K + 1 slots of
t_j mapped by ``first_tokens.vocab_map`` and puts y_j at slot r_{t_j} (``alignment_row``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_kd_plugin.cache.cross_tokenizer.first_tokens import FirstTokens
from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes

MID_CANDIDATES = 16
"""Candidates kept per position inside a teacher token (the realised one and the most probable others)."""


@dataclasses.dataclass(frozen=True)
class TokenSlots:
    """The arrays of the module docstring, for one sample."""

    sources: np.ndarray
    realised: np.ndarray
    mid_counts: np.ndarray
    mid_ids: np.ndarray
    mid_logprobs: np.ndarray


def realised_slots(tokens: np.ndarray, topk_ids: np.ndarray) -> np.ndarray:
    """int16 [S]: r_t, the slot of x_{t+1} among the top-K ``topk_ids`` [S, K], K where the top-K lacks it."""
    hit = topk_ids == np.asarray(tokens)[1:, None]
    k = topk_ids.shape[1]
    return np.where(hit.any(1), hit.argmax(1), k).astype(np.int16)


def read_positions(teacher_ends: np.ndarray, student_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(t_j [n], o_j [n]) of student tokens ending at ``student_ends`` [n] against teacher tokens ending at
    ``teacher_ends`` [S + 1] (module docstring; t_j = -1 where b_j < e_0 or j = n - 1, none past cache position S -
    1)."""
    sources = np.searchsorted(teacher_ends, student_ends, side="right") - 1            # [n] t_j
    sources[-1:] = -1                                                                   # no label after the last
    sources = np.where(sources < len(teacher_ends) - 1, sources, -1)
    return sources, student_ends - teacher_ends[np.maximum(sources, 0)]


def token_slots(tokens: np.ndarray, teacher_ends: np.ndarray, student_ids: np.ndarray, student_ends: np.ndarray,
                topk_ids: np.ndarray, topk_logprobs: np.ndarray, realised_logprobs: np.ndarray, teacher: TokenBytes,
                table: FirstTokens, *, mid_candidates: int = MID_CANDIDATES) -> TokenSlots:
    """The slots (module docstring) of a sample: teacher ``tokens`` [S + 1] ending at ``teacher_ends`` [S + 1], the
    student's ``student_ids`` [n] ending at ``student_ends`` [n] (bytes of the same text), the cached top-K
    ``topk_ids``, ``topk_logprobs`` [S, K] and ``realised_logprobs`` [S]; ``table``: the two tokenizers'
    ``FirstTokens``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n, k = len(student_ids), topk_ids.shape[1]
    sources, offsets = read_positions(teacher_ends, student_ends)                      # [n] t_j, o_j
    realised = realised_slots(tokens, topk_ids)
    mid = np.flatnonzero((sources >= 0) & (offsets > 0))                               # [M] positions inside a token
    counts = np.zeros(n, dtype=np.uint8)
    if mid.size == 0:
        return TokenSlots(sources.astype(np.int32), realised, counts, np.zeros(0, np.int32), np.zeros(0, np.float32))
    t, o = sources[mid], offsets[mid][:, None]                                        # [M], [M, 1]
    x = tokens[t + 1]                                                                  # [M] realised teacher token
    candidates = np.concatenate([topk_ids[t].astype(np.int64), x[:, None]], 1)        # [M, K + 1]
    logprobs = np.concatenate([topk_logprobs[t].astype(np.float64),
                               np.asarray(realised_logprobs, dtype=np.float64)[t][:, None]], 1)
    slot = realised[t].astype(np.int64)[:, None]                                       # [M, 1] r_t
    columns = np.arange(k + 1)
    logprobs[(columns == k) & (slot < k)] = -np.inf                                    # slot K empty: x in the top-K
    lengths = teacher.lengths[candidates]                                              # [M, K + 1]
    index = table.base[candidates] + np.minimum(o, lengths)
    consistent = (lengths >= o) & (table.node[index] == table.node[table.base[x][:, None] + o])
    consistent &= logprobs > -np.inf
    log_z = np.logaddexp.reduce(np.where(consistent, logprobs, -np.inf), axis=1, keepdims=True)   # [M, 1]
    reached = np.where(lengths > o, table.first[np.minimum(index, len(table.first) - 1)], -1)
    is_realised = columns == slot
    reached = np.where(is_realised, np.asarray(student_ids)[mid + 1][:, None], reached)
    kept = consistent & (reached >= 0)
    order_key = np.where(is_realised & kept, np.inf, np.where(kept, logprobs, -np.inf))
    order = np.argsort(-order_key, axis=1, kind="stable")[:, :mid_candidates]          # [M, J]
    keep = np.take_along_axis(kept, order, 1)
    counts[mid] = keep.sum(1)
    sources[mid[counts[mid] == 0]] = -1                                                # no candidate left: CE only
    chosen_ids = np.take_along_axis(reached, order, 1)[keep].astype(np.int32)
    chosen_logprobs = (np.take_along_axis(logprobs, order, 1) - log_z)[keep].astype(np.float32)
    return TokenSlots(sources.astype(np.int32), realised, counts, chosen_ids, chosen_logprobs)
