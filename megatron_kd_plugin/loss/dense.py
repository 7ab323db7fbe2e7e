"""Dense top-K KD, the reference: full logits [T, V] (gathered over TP), the teacher expanded into a [T, V] grid,
the loss written from its definition on the grid and differentiated by autograd. Memory ~ 5-6 T*V tensors.
``tail="sampled"``: the grid holds the importance-weighted estimate P^ of the teacher (weights of repeated draws
summed) and f = sum_k w_k l_k - sum_v P^_v log q_v.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .divergence import bucket_divergence
from .options import KDLossOptions
from .tp import VocabShard


@torch.no_grad()
def _teacher_grid(teacher_ids, teacher_logprobs, logits, options: KDLossOptions, dtype):
    """Teacher buckets on the grid of the student's raw ``logits`` [T, V]: (log P [T, V] (-inf off the support),
    support [T, V] bool, m [T], ghost tail log P [T], tail present [T]). Repeated ids add up; m and the tail's
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
    return log_p, support, mass, tail.to(dtype), tail_present & (options.tail == "ghost")


@torch.no_grad()
def _sampled_grid(teacher_ids, teacher_logprobs, sample_weights, shape, dtype):
    """(P^ [T, V]: the summed weights of each drawn id, sum_k w_k l_k [T]); a slot is drawn when l > -inf, w > 0."""
    weights = torch.where((teacher_logprobs > -torch.inf) & (sample_weights > 0), sample_weights.to(dtype), 0.0)
    p_hat = torch.zeros(shape, dtype=dtype, device=teacher_ids.device).scatter_add_(-1, teacher_ids, weights)
    return p_hat, torch.where(weights > 0, weights * teacher_logprobs, 0.0).sum(-1)


def dense_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, teacher_ids: torch.Tensor,
                  teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, labels: torch.Tensor | None,
                  options: KDLossOptions, shard: VocabShard, dtype: torch.dtype,
                  sample_weights: torch.Tensor | None = None):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H], teacher [T, K] (and sample_weights [T, K] for
    tail="sampled"), loss_mask/labels [T] -> (loss_sum, kd_sum, ce_sum, student_mass_sum)."""
    tau = options.temperature
    logits = hidden.to(dtype) @ weight.to(dtype).t()                         # [T, V/tp]
    if shard.group is not None:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=shard.group)   # [T, V]
    weights = loss_mask.to(dtype)
    ce_sum = weights.new_zeros(())
    if labels is not None:                                                   # CE at tau = 1
        ce = F.cross_entropy(logits, labels.long(), reduction="none")
        ce_sum = (weights * torch.where(loss_mask != 0, ce, 0.0)).sum()
    log_q = (logits if tau == 1.0 else logits / tau).log_softmax(-1)         # [T, V] student log q
    if options.tail == "sampled":
        p_hat, cross = _sampled_grid(teacher_ids.long(), teacher_logprobs.to(dtype), sample_weights, log_q.shape,
                                     dtype)
        kd = cross - (p_hat * log_q).sum(-1)
        with torch.no_grad():
            student_mass = torch.where(p_hat > 0, log_q.exp(), 0.0).sum(-1)
        return _sums(kd, student_mass, ce_sum, loss_mask, options)
    log_p, support, mass, tail_p, tail_present = _teacher_grid(teacher_ids.long(), teacher_logprobs, logits,
                                                               options, dtype)
    del logits
    has_support = support.any(-1)
    with torch.no_grad():
        student_mass = torch.where(support, log_q.exp(), 0.0).sum(-1)
    if options.tail == "renorm":                                             # Q_k = q_k / sum_S q
        log_q = torch.where(has_support[:, None], log_q.masked_fill(~support, -torch.inf), 0.0).log_softmax(-1)
    kd = bucket_divergence(log_p, log_q, support, options.divergence, options.jsd_beta)
    if options.tail == "ghost":                                              # the tail bucket, 1 - s
        tail_q = torch.where(support, 0.0, log_q.exp()).sum(-1)
        tail_used = tail_present & ((tail_p > -torch.inf) | (tail_q > 0))     # P = Q = 0: adds 0 (no 0 log 0)
        log_tail_q = torch.where(tail_used, tail_q, 1.0).log()
        kd = kd + bucket_divergence(tail_p[:, None], log_tail_q[:, None], tail_used[:, None],
                                    options.divergence, options.jsd_beta)
    return _sums(torch.where(has_support | (options.tail != "renorm"), kd, 0.0), student_mass, ce_sum, loss_mask,
                 options)


def _sums(kd, student_mass, ce_sum, loss_mask, options: KDLossOptions):
    """Per-token kd [T] and student mass [T] -> (loss_sum, kd_sum, ce_sum, student_mass_sum) over counted tokens."""
    counted = loss_mask != 0
    kd_sum = (loss_mask.to(kd.dtype) * torch.where(counted, kd, 0.0)).sum()
    mass_sum = torch.where(counted, student_mass, 0.0).sum()
    loss_sum = options.alpha * options.temperature ** 2 * kd_sum + (1.0 - options.alpha) * ce_sum
    return loss_sum, kd_sum.detach(), ce_sum.detach(), mass_sum
