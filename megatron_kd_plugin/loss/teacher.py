"""The teacher's side of the loss, computed once per call from the cached top-K (T*K work, no vocab).

Shape: ``ids`` [T, K] global vocab ids, ``logprobs`` [T, K] log-probs over the teacher's full vocab
(-inf marks a padding slot: probability 0, not part of the support).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TeacherBuckets(NamedTuple):
    """The teacher's tempered bucket log-probs (see ``token_math`` for the formulas). Row-sliceable."""

    ids: torch.Tensor           # [T, K] int64, sorted per token; a repeated id is merged into its first slot
    valid: torch.Tensor         # [T, K] bool: the slot is a bucket (a distinct id with probability > 0)
    log_p: torch.Tensor         # [T, K] tempered log-prob of each slot's bucket, -inf where not valid
    log_p_tail: torch.Tensor    # [T] ghost: tempered log-prob of the tail bucket (-inf where absent)
    tail_present: torch.Tensor  # [T] bool: ghost and the vocab has ids outside the support
    mass: torch.Tensor          # [T] untempered top-K mass m = sum_k exp(l_k)

    def rows(self, rows: slice) -> TeacherBuckets:
        """The buckets of tokens ``rows``."""
        return TeacherBuckets(*(t[rows] for t in self))


def merge_duplicate_ids(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's ids and merge repeats: the first slot of an id gets log(sum of its probabilities), the
    repeats get -inf. Returns (ids [T, K] int64 sorted, logprobs [T, K])."""
    ids, order = ids.long().sort(dim=-1, stable=True)
    logprobs = logprobs.gather(-1, order)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    segment = first.long().cumsum(-1) - 1                                      # [T, K] run index of each slot
    neg_inf = torch.full_like(logprobs, -torch.inf)
    run_max = neg_inf.scatter_reduce(-1, segment, logprobs, reduce="amax")     # [T, K] per run
    slot_max = run_max.gather(-1, segment)
    finite_max = torch.where(slot_max > -torch.inf, slot_max, torch.zeros_like(slot_max))
    run_sum = torch.zeros_like(logprobs).scatter_add(-1, segment, (logprobs - finite_max).exp())
    merged = run_max + run_sum.log()                                           # -inf + log 0 = -inf for all-padding
    return ids, torch.where(first, merged.gather(-1, segment), neg_inf)


def teacher_buckets(ids: torch.Tensor, logprobs: torch.Tensor, *, tail: str, temperature: float,
                    vocab_size: int) -> TeacherBuckets:
    """Merge repeated ids, then temper within the tail mode's buckets. ``vocab_size``: V (padded, all ranks)."""
    ids, logprobs = merge_duplicate_ids(ids, logprobs)
    valid = logprobs > -torch.inf
    neg_inf = torch.full_like(logprobs, -torch.inf)
    mass = torch.where(valid, logprobs.exp(), torch.zeros_like(logprobs)).sum(-1)       # [T]
    tempered = logprobs / temperature
    any_valid = valid.any(-1, keepdim=True)
    no_tail = torch.full_like(mass, -torch.inf)
    tail_present = torch.zeros_like(mass, dtype=torch.bool)
    if tail == "ghost":
        tail_present = valid.sum(-1) < vocab_size
        raw_tail = torch.where(tail_present, torch.log1p(-mass.clamp(max=1.0)), no_tail)  # log(1 - m)
        buckets = torch.cat([tempered, (raw_tail / temperature)[:, None]], dim=-1).log_softmax(-1)
        return TeacherBuckets(ids, valid, buckets[:, :-1], buckets[:, -1], tail_present, mass)
    shape = torch.where(any_valid, tempered, torch.zeros_like(tempered)).log_softmax(-1)  # softmax_K(l / tau)
    shape = torch.where(valid, shape, neg_inf)
    if tail == "none":                                                          # keeps the teacher's mass m
        shape = torch.where(valid, shape + mass.log()[:, None], neg_inf)
    return TeacherBuckets(ids, valid, shape, no_tail, tail_present, mass)
