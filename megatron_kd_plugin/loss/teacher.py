"""The teacher as the losses receive it, and the pieces every kind of teacher shares.

A teacher travels as a typed value (a NamedTuple of tensors) from a store's rows to the loss, in the store's dtypes
(int32 ids, the decoded log-probs); the loss converts where its math needs another. Shapes: [..., K] per token, the
leading dimensions the caller's ([b, s] batch-first from a dataset, [s, b] in the loss, [T] flattened inside it).

The top-K loss takes a ``SlotTeacher``: K slots per token, ids and log-probs over the teacher's full vocab (-inf
marks a padding slot: probability 0, not part of the support) and, for draws, importance weights. Each kind says
what its slots mean (``topk_teacher.TopKTeacher``, ``sampled_teacher.SampledTeacher``): its buckets (``token_math``
for the formulas), its mass, the tails it serves and its dense definition (the reference's). The buckets are formed
in float64 whatever the input dtype: the ghost tail's 1 - m is lost in float32 below ~6e-8 (m rounds to 1), and
tempering log(1 - m) amplifies the error; only the finished log-probs are rounded to the accumulation dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar

import torch

from .options import KDLossOptions


Tensors = TypeVar("Tensors", bound=tuple)


def tensor_map(fn: Callable[[torch.Tensor], torch.Tensor], value: Tensors) -> Tensors:
    """``value`` (a NamedTuple of tensors, nested NamedTuples and None) with ``fn`` applied to every tensor."""
    return type(value)(*(None if item is None else fn(item) if isinstance(item, torch.Tensor)
                         else tensor_map(fn, item) for item in value))


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


class SlotTeacher(Protocol):
    """What the top-K loss needs of a teacher given as K slots per token (``ids``, ``logprobs`` [..., K])."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    @property
    def weights(self) -> torch.Tensor | None:
        """[..., K] the slots' importance weights (None: every slot is a top-K entry)."""

    @classmethod
    def check_tail(cls, tail: str, where: str) -> None:
        """ValueError, in one line naming the tail to use, for a ``kd.tail`` these slots cannot serve (``where``:
        what holds them, for the message): the one place that decides which tails a kind of slots takes."""

    def buckets(self, *, tail: str, temperature: float, vocab_size: int) -> tuple[torch.Tensor, TeacherBuckets]:
        """[T, K] slots -> (ids [T, K] sorted per token in their dtype, a repeated id merged into its first slot;
        the float64 buckets). ``vocab_size``: V (padded, all ranks)."""

    def padded(self, k: int) -> SlotTeacher:
        """The same teacher in ``k`` >= K slots per token (padding slots hold no support): rows of stores of
        different K side by side (a blend, ``cache.rows.blended_rows``)."""

    def mass(self) -> torch.Tensor:
        """[...] the untempered mass of the slots (float64)."""

    def dense_kd(self, logits: torch.Tensor, log_q: torch.Tensor,
                 options: KDLossOptions) -> tuple[torch.Tensor, torch.Tensor]:
        """The definition on the full vocab (the dense reference): raw logits [T, V], the student's log q at tau
        [T, V] -> (KD f [T], differentiable through log_q; student mass on the support [T])."""


def pad_slots(tensors: tuple[torch.Tensor, ...], k: int, fills: tuple[float, ...]) -> list[torch.Tensor]:
    """Each [..., K] tensor widened to [..., k] with its ``fills`` value in the new slots (ValueError if k < K)."""
    width = tensors[0].shape[-1]
    if k < width:
        raise ValueError(f"cannot pad {width} slots to {k}")
    return [t if k == width else torch.cat([t, t.new_full((*t.shape[:-1], k - width), fill)], dim=-1)
            for t, fill in zip(tensors, fills, strict=True)]


def sorted_runs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort each token's ids [..., K]: (ids sorted, in their dtype; the sorting order; first bool: the first slot of a
    run)."""
    ids, order = ids.sort(dim=-1, stable=True)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return ids, order, first


def merge_duplicate_ids(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's ids and merge repeats: the first slot of an id gets log(sum of its probabilities), the
    repeats get -inf. Returns (ids [T, K] sorted, in their dtype; logprobs [T, K])."""
    ids, order, first = sorted_runs(ids)
    logprobs = logprobs.gather(-1, order)
    segment = first.long().cumsum(-1) - 1                                      # [T, K] run index of each slot
    neg_inf = torch.full_like(logprobs, -torch.inf)
    run_max = neg_inf.scatter_reduce(-1, segment, logprobs, reduce="amax")     # [T, K] per run
    slot_max = run_max.gather(-1, segment)
    finite_max = torch.where(slot_max > -torch.inf, slot_max, torch.zeros_like(slot_max))
    run_sum = torch.zeros_like(logprobs).scatter_add(-1, segment, (logprobs - finite_max).exp())
    merged = run_max + run_sum.log()                                           # -inf + log 0 = -inf for all-padding
    return ids, torch.where(first, merged.gather(-1, segment), neg_inf)


