"""The teacher's side of the loss, computed once per call from the cached top-K (T*K work, no vocab).

The buckets are formed in float64 whatever the input dtype: the ghost tail's 1 - m is lost in float32 below
~6e-8 (m rounds to 1), and tempering log(1 - m) amplifies the error; only the finished log-probs are rounded to
the accumulation dtype (their logarithms are well-conditioned there).

Shape: ``ids`` [T, K] global vocab ids, ``logprobs`` [T, K] log-probs over the teacher's full vocab
(-inf marks a padding slot: probability 0, not part of the support), ``sample_weights`` [T, K] (tail ``sampled``
only) the importance weight w of each drawn slot; a slot is drawn when its log-prob is finite and w > 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TeacherBuckets(NamedTuple):
    """The teacher's tempered bucket log-probs (see ``token_math`` for the formulas), slot k of the token's ids as
    sorted by ``teacher_buckets``. Row-sliceable."""

    valid: torch.Tensor         # [T, K] bool: the slot is a bucket (a distinct id with probability > 0)
    log_p: torch.Tensor         # [T, K] tempered log-prob of each slot's bucket, -inf where not valid (ghost at
    #                             tau != 1: l / tau, normalised per chunk with the student's tail, ``token_math``)
    log_p_tail: torch.Tensor    # [T] ghost: tempered log-prob of the tail bucket, -inf where absent (at tau != 1:
    #                             log(1 - m) / tau, before the student's tail shape and the normalisation)
    tail_present: torch.Tensor  # [T] bool: ghost and the vocab has ids outside the support
    mass: torch.Tensor          # [T] untempered top-K mass m = sum_k exp(l_k) (sampled: of the distinct drawn ids)
    value_offset: torch.Tensor  # [T] sampled: sum_k w_k l_k - sum_b P_b log P_b (0 for the other tails)

    def rows(self, rows: slice) -> TeacherBuckets:
        """The buckets of tokens ``rows``."""
        return TeacherBuckets(*(t[rows] for t in self))


def _sorted_runs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort each token's ids [..., K]: (ids int64 sorted, the sorting order, first bool: the first slot of a run)."""
    ids, order = ids.long().sort(dim=-1, stable=True)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return ids, order, first


def merge_duplicate_ids(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's ids and merge repeats: the first slot of an id gets log(sum of its probabilities), the
    repeats get -inf. Returns (ids [T, K] int64 sorted, logprobs [T, K])."""
    ids, order, first = _sorted_runs(ids)
    logprobs = logprobs.gather(-1, order)
    segment = first.long().cumsum(-1) - 1                                      # [T, K] run index of each slot
    neg_inf = torch.full_like(logprobs, -torch.inf)
    run_max = neg_inf.scatter_reduce(-1, segment, logprobs, reduce="amax")     # [T, K] per run
    slot_max = run_max.gather(-1, segment)
    finite_max = torch.where(slot_max > -torch.inf, slot_max, torch.zeros_like(slot_max))
    run_sum = torch.zeros_like(logprobs).scatter_add(-1, segment, (logprobs - finite_max).exp())
    merged = run_max + run_sum.log()                                           # -inf + log 0 = -inf for all-padding
    return ids, torch.where(first, merged.gather(-1, segment), neg_inf)


def _drawn(logprobs: torch.Tensor, sample_weights: torch.Tensor) -> torch.Tensor:
    """[T, K] bool: the slot holds a drawn id (finite log-prob, positive weight)."""
    return (logprobs > -torch.inf) & (sample_weights > 0)


def teacher_mass(ids: torch.Tensor, logprobs: torch.Tensor, sample_weights: torch.Tensor | None) -> torch.Tensor:
    """[..., K] slots -> [...] untempered mass of the teacher's slots: sum_k exp(l_k) (repeated top-K slots split an id's mass), or with
    ``sample_weights`` the mass of the distinct drawn ids (a repeated draw is counted once)."""
    probs = logprobs.exp()                                                     # exp(-inf) = 0 at padding
    if sample_weights is None:
        return probs.sum(-1)
    drawn = _drawn(logprobs, sample_weights)
    _, order, first = _sorted_runs(torch.where(drawn, ids.long(), -1))        # undrawn slots share the run of -1
    return torch.where(first & drawn.gather(-1, order), probs.gather(-1, order), 0.0).sum(-1)


def _sampled_buckets(ids: torch.Tensor, logprobs: torch.Tensor,
                     sample_weights: torch.Tensor) -> tuple[torch.Tensor, TeacherBuckets]:
    """``sampled``: bucket P_b = the summed weight of a distinct drawn id; the value offset makes
    f = KL(P || Q) + offset = sum_k w_k (l_k - log Q_{I_k})."""
    drawn = _drawn(logprobs, sample_weights)
    weights = sample_weights.to(logprobs.dtype)
    cross = torch.where(drawn, weights * logprobs, 0.0).sum(-1)               # [T] sum_k w_k l_k
    mass = teacher_mass(ids, logprobs, sample_weights)
    ids, log_p = merge_duplicate_ids(ids, torch.where(drawn, weights.log(), -torch.inf))   # log of summed weights
    valid = log_p > -torch.inf
    offset = cross - torch.where(valid, log_p.exp() * log_p, 0.0).sum(-1)
    no_tail = torch.full_like(mass, -torch.inf)
    return ids, TeacherBuckets(valid, log_p, no_tail, torch.zeros_like(valid[:, 0]), mass, offset)


def teacher_buckets(ids: torch.Tensor, logprobs: torch.Tensor, *, tail: str, temperature: float, vocab_size: int,
                    dtype: torch.dtype, sample_weights: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                              TeacherBuckets]:
    """Merge repeated ids, then temper within the tail mode's buckets (``sampled``: weights summed per id, no
    tempering), in float64; the buckets are returned in ``dtype``. ``vocab_size``: V (padded, all ranks).
    Returns (ids [T, K] int64 sorted per token, a repeated id merged into its first slot; the buckets)."""
    logprobs = logprobs.to(torch.float64)
    if tail == "sampled":
        ids, buckets = _sampled_buckets(ids, logprobs, sample_weights.to(torch.float64))
    else:
        ids, buckets = _topk_buckets(ids, logprobs, tail, temperature, vocab_size)
    return ids, TeacherBuckets(*(t.to(dtype) if t.is_floating_point() else t for t in buckets))


def _topk_buckets(ids: torch.Tensor, logprobs: torch.Tensor, tail: str, temperature: float,
                  vocab_size: int) -> tuple[torch.Tensor, TeacherBuckets]:
    """``ghost`` / ``none`` / ``renorm`` buckets of the K slots (``token_math``)."""
    ids, logprobs = merge_duplicate_ids(ids, logprobs)
    valid = logprobs > -torch.inf
    neg_inf = torch.full_like(logprobs, -torch.inf)
    mass = torch.where(valid, logprobs.exp(), torch.zeros_like(logprobs)).sum(-1)       # [T]
    zero = torch.zeros_like(mass)
    tempered = logprobs / temperature
    any_valid = valid.any(-1, keepdim=True)
    no_tail = torch.full_like(mass, -torch.inf)
    tail_present = torch.zeros_like(mass, dtype=torch.bool)
    if tail == "ghost":
        tail_present = valid.sum(-1) < vocab_size
        raw_tail = torch.where(tail_present, torch.log1p(-mass.clamp(max=1.0)), no_tail)  # log(1 - m)
        if temperature != 1.0:                           # finished per chunk, with the student's tail shape
            return ids, TeacherBuckets(valid, torch.where(valid, tempered, neg_inf), raw_tail / temperature,
                                       tail_present, mass, zero)
        buckets = torch.cat([tempered, raw_tail[:, None]], dim=-1).log_softmax(-1)
        return ids, TeacherBuckets(valid, buckets[:, :-1], buckets[:, -1], tail_present, mass, zero)
    shape = torch.where(any_valid, tempered, torch.zeros_like(tempered)).log_softmax(-1)  # softmax_K(l / tau)
    shape = torch.where(valid, shape, neg_inf)
    if tail == "none":                                                          # keeps the teacher's mass m
        shape = torch.where(valid, shape + mass.log()[:, None], neg_inf)
    return ids, TeacherBuckets(valid, shape, no_tail, tail_present, mass, zero)
