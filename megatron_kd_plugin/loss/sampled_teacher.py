"""N ids drawn per token from the teacher (sampled stores' rows) with their importance weights: the ``sampled``
tail's buckets (``token_math``: P_b the summed weight of a distinct drawn id, an unbiased estimate of the teacher)
and their dense definition. A slot is drawn when its log-prob is finite and its weight > 0."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .options import KDLossOptions
from .teacher import TeacherBuckets, merge_duplicate_ids, pad_slots, sorted_runs


class SampledTeacher(NamedTuple):
    """N ids drawn per token from the teacher, with their importance weights (a ``SlotTeacher``)."""

    ids: torch.Tensor        # [..., N] int drawn ids, repeats kept
    logprobs: torch.Tensor   # [..., N] float the teacher's log-prob of each drawn id
    weights: torch.Tensor    # [..., N] float importance weights w = p / (N q') (``token_math``)

    @classmethod
    def check_tail(cls, tail: str, where: str = "a SampledTeacher") -> None:
        if tail != "sampled":
            raise ValueError(f"kd.tail={tail!r} does not fit {where}: its slots are draws (with importance weights), "
                             "not a top-K; use kd.tail='sampled'")

    def padded(self, k: int) -> SampledTeacher:
        """The same draws in ``k`` >= N slots: undrawn slots (id 0, log-prob -inf, weight 0) appended."""
        return SampledTeacher(*pad_slots((self.ids, self.logprobs, self.weights), k, (0, -torch.inf, 0.0)))

    def mass(self) -> torch.Tensor:
        """The mass of the distinct drawn ids (a repeated draw is counted once)."""
        probs, drawn = self.logprobs.double().exp(), _drawn(self.logprobs, self.weights)
        _, order, first = sorted_runs(torch.where(drawn, self.ids, -1))        # undrawn slots share the run of -1
        return torch.where(first & drawn.gather(-1, order), probs.gather(-1, order), 0.0).sum(-1)

    def buckets(self, *, tail: str, temperature: float, vocab_size: int) -> tuple[torch.Tensor, TeacherBuckets]:
        """P_b = the summed weight of a distinct drawn id; the value offset makes
        f = KL(P || Q) + offset = sum_k w_k (l_k - log Q_{I_k})."""
        logprobs, weights = self.logprobs.double(), self.weights.double()
        drawn = _drawn(logprobs, weights)
        cross = torch.where(drawn, weights * logprobs, 0.0).sum(-1)                # [T] sum_k w_k l_k
        mass = self.mass()
        ids, log_p = merge_duplicate_ids(self.ids, torch.where(drawn, weights.log(), -torch.inf))  # log summed weight
        valid = log_p > -torch.inf
        offset = cross - torch.where(valid, log_p.exp() * log_p, 0.0).sum(-1)
        no_tail = torch.full_like(mass, -torch.inf)
        return ids, TeacherBuckets(valid, log_p, no_tail, torch.zeros_like(valid[:, 0]), mass, offset)

    def dense_kd(self, logits: torch.Tensor, log_q: torch.Tensor,
                 options: KDLossOptions) -> tuple[torch.Tensor, torch.Tensor]:
        """f = sum_k w_k l_k - sum_v P^_v log q_v, P^ [T, V] the summed weights of each drawn id."""
        with torch.no_grad():
            weights = torch.where(_drawn(self.logprobs, self.weights), self.weights.to(log_q.dtype), 0.0)
            p_hat = torch.zeros_like(log_q).scatter_add_(-1, self.ids.long(), weights)
            cross = torch.where(weights > 0, weights * self.logprobs.to(log_q.dtype), 0.0).sum(-1)
            student_mass = torch.where(p_hat > 0, log_q.exp(), 0.0).sum(-1)
        return cross - (p_hat * log_q).sum(-1), student_mass


def _drawn(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, K] bool: the slot holds a drawn id (finite log-prob, positive weight)."""
    return (logprobs > -torch.inf) & (weights > 0)
