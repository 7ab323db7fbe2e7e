"""The two reference formulations of the top-K loss, kept beside the fused one as the published comparison's
baselines: same options, same results (``topk_kd_loss(impl="dense" | "forward_chunked")``).

``dense_topk_kl`` — full logits [T, V] (gathered over TP), the teacher expanded into a [T, V] grid by its own
definition (``SlotTeacher.dense_kd``), the loss written on the grid and differentiated by autograd. Memory ~ 5-6
T*V tensors.

``forward_chunked_topk_kl`` — the full logits [T, V/tp] exist, the teacher stays sparse, and the loss and
d loss / d logits are formed chunk by chunk (the shared ``chunk_loop``) into a [T, V/tp] gradient buffer during
forward (memory ~ 2 T V/tp; ``mode`` does not apply). Autograd then forms dX = G W and dW = G^T X.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunk_loop import forward_pass, group_sums
from .loss_plan import KDBatch, LossPlan
from .fused_head import input_grads, loss_totals
from .options import KDLossOptions
from .teacher import SlotTeacher
from .tp import VocabShard


def dense_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, teacher: SlotTeacher, loss_mask: torch.Tensor,
                  labels: torch.Tensor | None, options: KDLossOptions, shard: VocabShard, dtype: torch.dtype,
                  groups: torch.Tensor | None = None, num_groups: int = 0):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H], teacher [T, K] (its dense definition:
    ``SlotTeacher.dense_kd``), loss_mask/labels/groups [T] -> (loss_sum, kd_sum, ce_sum, student_mass_sum, group
    sums [G, 2])."""
    tau = options.temperature
    logits = hidden.to(dtype) @ weight.to(dtype).t()                         # [T, V/tp]
    if shard.group is not None:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=shard.group)   # [T, V]
    weights = loss_mask.to(dtype)
    counted = loss_mask != 0
    ce = weights.new_zeros(weights.shape)
    if labels is not None:                                                   # CE at tau = 1
        ce = weights * torch.where(counted, F.cross_entropy(logits, labels.long(), reduction="none"), 0.0)
    log_q = (logits if tau == 1.0 else logits / tau).log_softmax(-1)         # [T, V] student log q
    kd, student_mass = teacher.dense_kd(logits.detach(), log_q, options)
    kd = weights * torch.where(counted, kd, 0.0)                            # [T] w_t f_t
    kd_sum, ce_sum = kd.sum(), ce.sum()
    loss_sum = options.alpha * options.temperature ** 2 * kd_sum + (1.0 - options.alpha) * ce_sum
    groups = group_sums(num_groups, groups, (kd.detach(), ce.detach())).reshape(-1, 2)
    return (loss_sum, kd_sum.detach(), ce_sum.detach(), torch.where(counted, student_mass, 0.0).sum(), groups)


class _ChunkedLogitsKL(torch.autograd.Function):
    """logits [T, V/tp] -> (loss_sum, kd_sum, ce_sum, student_mass_sum, group sums [G, 2])."""

    @staticmethod
    def forward(ctx, logits, plan: LossPlan, batch: KDBatch):
        dtype = plan.dtype
        grad = torch.empty(logits.shape, dtype=dtype, device=logits.device) if input_grads(ctx, plan)[0] else None

        def logits_chunk(rows: slice) -> torch.Tensor:                       # the gradient rows double as buffer
            buffer = grad[rows] if grad is not None else logits.new_empty(logits[rows].shape, dtype=dtype)
            return buffer.copy_(logits[rows])

        on_grad = (lambda rows, chunk_grad: None) if grad is not None else None   # already written in place
        totals, _ = forward_pass(plan, batch, logits_chunk, on_grad, keep_coefs=False)
        ctx.grad, ctx.logits_dtype = grad, logits.dtype
        return loss_totals(ctx, plan, totals)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grad is None:
            raise RuntimeError("the forward-chunked KD loss supports one backward per forward")
        grad, ctx.grad = ctx.grad, None
        return grad.mul_(grad_loss.to(grad.dtype)).to(ctx.logits_dtype), None, None


def forward_chunked_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum, group
    sums [G, 2])."""
    logits = hidden @ weight.t()                                             # [T, V/tp]
    return _ChunkedLogitsKL.apply(logits, plan, batch)
