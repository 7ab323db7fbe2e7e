"""Forward-chunked top-K KD (a baseline): the full logits [T, V/tp] exist, the teacher stays sparse, and the loss
and d loss / d logits are formed chunk by chunk into a [T, V/tp] gradient buffer during forward (memory ~ 2 T V/tp;
``mode`` does not apply). Autograd then forms dX = G W and dW = G^T X.
"""

from __future__ import annotations

import torch

from .plan import KDBatch, LossPlan, input_grads, loss_totals
from .vocab_loop import forward_pass


class _ChunkedLogitsKL(torch.autograd.Function):
    """logits [T, V/tp] -> (loss_sum, kd_sum, ce_sum, student_mass_sum)."""

    @staticmethod
    def forward(ctx, logits, plan: LossPlan, batch: KDBatch):
        dtype = plan.dtype
        grad = torch.empty(logits.shape, dtype=dtype, device=logits.device) if input_grads(ctx, plan)[0] else None

        def logits_chunk(rows: slice) -> torch.Tensor:                       # the gradient rows double as buffer
            buffer = grad[rows] if grad is not None else torch.empty(logits[rows].shape, dtype=dtype, device=logits.device)
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
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum)."""
    logits = hidden @ weight.t()                                             # [T, V/tp]
    return _ChunkedLogitsKL.apply(logits, plan, batch)
