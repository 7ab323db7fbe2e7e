"""A teacher's top-K per token (top-K and top-p stores' rows): the ``ghost``, ``none`` and ``renorm`` buckets of
its K slots (``token_math``), and their dense definition."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .divergence import bucket_divergence
from .options import KDLossOptions
from .teacher import TeacherBuckets, merge_duplicate_ids, pad_slots


class TopKTeacher(NamedTuple):
    """A teacher's top-K (or top-p) per token: the distribution the token was predicted from (a ``SlotTeacher``)."""

    ids: torch.Tensor        # [..., K] int global vocab ids (a store's rows: int32, ascending per token)
    logprobs: torch.Tensor   # [..., K] float log-probs over the teacher's full vocab; -inf: a padding slot

    @property
    def weights(self) -> None:
        return None

    @classmethod
    def check_tail(cls, tail: str, where: str = "a TopKTeacher") -> None:
        if tail == "sampled":
            raise ValueError(f"kd.tail='sampled' does not fit {where}: its slots are a top-K, and the sampled tail "
                             "needs draws (a store written with --draws N); use kd.tail='renorm' (a student from "
                             "trained weights) or 'ghost'")

    def padded(self, k: int) -> TopKTeacher:
        """The same teacher in ``k`` >= K slots: padding slots (id 0, log-prob -inf: no support) appended."""
        return TopKTeacher(*pad_slots((self.ids, self.logprobs), k, (0, -torch.inf)))

    def mass(self) -> torch.Tensor:
        """sum_k exp(l_k) (repeated slots split an id's mass)."""
        return self.logprobs.double().exp().sum(-1)                        # exp(-inf) = 0 at padding

    def buckets(self, *, tail: str, temperature: float, vocab_size: int) -> tuple[torch.Tensor, TeacherBuckets]:
        return _topk_buckets(self.ids, self.logprobs.double(), tail, temperature, vocab_size)

    def dense_kd(self, logits: torch.Tensor, log_q: torch.Tensor,
                 options: KDLossOptions) -> tuple[torch.Tensor, torch.Tensor]:
        log_p, support, tail_p, tail_present = _grid(self.ids.long(), self.logprobs, logits, options, log_q.dtype)
        has_support = support.any(-1)
        with torch.no_grad():
            student_mass = torch.where(support, log_q.exp(), 0.0).sum(-1)
        if options.tail == "renorm":                                         # Q_k = q_k / sum_S q
            log_q = torch.where(has_support[:, None], log_q.masked_fill(~support, -torch.inf), 0.0).log_softmax(-1)
        kd = bucket_divergence(log_p, log_q, support, options.divergence, options.jsd_beta)
        if options.tail == "ghost":                                          # the tail bucket, 1 - s
            tail_q = torch.where(support, 0.0, log_q.exp()).sum(-1)
            tail_used = tail_present & ((tail_p > -torch.inf) | (tail_q > 0))  # P = Q = 0: adds 0 (no 0 log 0)
            log_tail_q = torch.where(tail_used, tail_q, 1.0).log()
            kd = kd + bucket_divergence(tail_p[:, None], log_tail_q[:, None], tail_used[:, None],
                                        options.divergence, options.jsd_beta)
        return torch.where(has_support | (options.tail != "renorm"), kd, 0.0), student_mass


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


@torch.no_grad()
def _grid(teacher_ids, teacher_logprobs, logits, options: KDLossOptions, dtype):
    """Teacher buckets on the grid of the student's raw ``logits`` [T, V]: (log P [T, V] (-inf off the support),
    support [T, V] bool, ghost tail log P [T], tail present [T]). Repeated ids add up; m and the tail's
    log(1 - m) in float64. The ghost tail at tau != 1 is (1 - m)^(1/tau) rho, rho from the student's tail shape
    (``token_math``), here summed over the grid."""
    tau, shape = options.temperature, logits.shape
    valid = teacher_logprobs > -torch.inf                                    # [T, K]
    log_p = torch.zeros(shape, dtype=dtype, device=teacher_ids.device)
    log_p.scatter_add_(-1, teacher_ids, torch.where(valid, teacher_logprobs.exp(), 0.0).to(dtype))   # P [T, V]
    support = torch.zeros(shape, dtype=torch.uint8, device=teacher_ids.device).scatter_reduce_(
        -1, teacher_ids, valid.to(torch.uint8), reduce="amax").bool()
    mass = torch.where(valid, teacher_logprobs.double().exp(), 0.0).sum(-1)  # [T] float64
    log_p.log_().div_(tau).masked_fill_(~support, -torch.inf)                # l / tau
    has_support = support.any(-1)
    tail_present = support.sum(-1) < shape[-1]
    tail = torch.full_like(mass, -torch.inf)
    if options.tail == "ghost":
        tail = torch.where(tail_present, torch.log1p(-mass.clamp(max=1.0)) / tau, -torch.inf)
        if tau != 1.0:
            off_support = logits.masked_fill(support, -torch.inf)                # [T, V] r off S
            unit = off_support.logsumexp(-1)
            tail = tail + torch.where(unit > -torch.inf, (off_support / tau).logsumexp(-1) - unit / tau, 0.0)
        norm = torch.logaddexp(log_p.logsumexp(-1), tail)
        tail = tail - norm
    else:
        norm = torch.where(has_support, log_p.logsumexp(-1), 0.0)
        if options.tail == "none":
            norm = norm - mass.log()
    log_p.sub_(norm[:, None].to(dtype))
    return log_p, support, tail.to(dtype), tail_present & (options.tail == "ghost")


