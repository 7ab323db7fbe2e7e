"""Dense top-K KD, the reference: full logits [T, V] (gathered over TP), the teacher expanded into a [T, V] grid,
the loss written from its definition on the grid and differentiated by autograd. Memory ~ several T*V tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .divergence import bucket_divergence
from .options import KDLossOptions
from .tp import VocabShard


def dense_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, teacher_ids: torch.Tensor,
                  teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, labels: torch.Tensor | None,
                  options: KDLossOptions, shard: VocabShard, dtype: torch.dtype):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H], teacher [T, K], loss_mask/labels [T]
    -> (loss_sum, kd_sum, ce_sum, student_mass_sum)."""
    tau, alpha = options.temperature, options.alpha
    logits = hidden.to(dtype) @ weight.to(dtype).t()                         # [T, V/tp]
    if shard.group is not None:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=shard.group)   # [T, V]
    z = logits / tau
    log_q_vocab = z.log_softmax(-1)                                          # [T, V]
    teacher_ids = teacher_ids.long()
    teacher_logprobs = teacher_logprobs.to(dtype)
    valid = teacher_logprobs > -torch.inf
    p_grid = torch.zeros_like(z, requires_grad=False).scatter_add(      # duplicates add up
        -1, teacher_ids, torch.where(valid, teacher_logprobs.exp(), torch.zeros_like(teacher_logprobs)))
    support = torch.zeros_like(z, requires_grad=False).scatter_add(-1, teacher_ids, valid.to(dtype)) > 0
    mass = p_grid.sum(-1)                                                    # [T]
    has_support = support.any(-1, keepdim=True)
    neg_inf = torch.full_like(z, -torch.inf)
    tempered = torch.where(support, p_grid.log() / tau, neg_inf)             # [T, V]
    if options.tail == "ghost":
        tail_present = support.sum(-1) < z.shape[-1]
        tail = torch.where(tail_present, torch.log1p(-mass.clamp(max=1.0)) / tau, -torch.inf)
        log_p = torch.cat([tempered, tail[:, None]], -1).log_softmax(-1)     # [T, V + 1]
        tail_q = torch.where(support, torch.zeros_like(z), log_q_vocab.exp()).sum(-1)
        log_tail_q = torch.where(tail_present, tail_q, torch.ones_like(tail_q)).log()
        log_q = torch.cat([log_q_vocab, log_tail_q[:, None]], -1)
        present = torch.cat([support, tail_present[:, None]], -1)
    else:
        log_p = torch.where(has_support, tempered, torch.zeros_like(tempered)).log_softmax(-1)
        if options.tail == "none":
            log_p = log_p + mass.log()[:, None]
            log_q = log_q_vocab
        else:
            log_q = torch.where(has_support, torch.where(support, z, neg_inf), torch.zeros_like(z)).log_softmax(-1)
        present = support
    counted = loss_mask != 0
    if options.tail == "renorm":
        counted = counted & has_support[:, 0]
    kd = torch.where(counted, bucket_divergence(log_p, log_q, present, options.divergence, options.jsd_beta), 0.0)
    kd_sum = (loss_mask.to(dtype) * kd).sum()
    ce_sum = kd_sum.new_zeros(())
    if labels is not None:
        ce = F.cross_entropy(logits, labels.long(), reduction="none")       # tau = 1
        ce_sum = (loss_mask.to(dtype) * torch.where(loss_mask != 0, ce, 0.0)).sum()
    student_mass = torch.where(support, log_q_vocab.exp(), torch.zeros_like(z)).sum(-1)
    mass_sum = torch.where(loss_mask != 0, student_mass, 0.0).sum()
    loss_sum = alpha * tau ** 2 * kd_sum + (1.0 - alpha) * ce_sum
    return loss_sum, kd_sum.detach(), ce_sum.detach(), mass_sum.detach()
