"""The ``renorm`` fast path: only the K rows W[I] of each token are needed, never the vocab.

Per chunk of c tokens: W_c = W[I_c] [c, K, H] (this shard's rows; other slots contribute 0), g = W_c x / tau [c, K]
summed over the group, then ``token_terms`` gives d loss / d g [c, K], dX_c = sum_k dg_k W[I_k] and
dW[I_k] += dg_k x. Cost T*K*H instead of T*V*H; gradients are formed in forward (they are as cheap as the loss).
"""

from __future__ import annotations

import torch

from .plan import KDBatch, LossPlan, finish_grad, loss_totals
from .token_math import TokenPartials, token_terms
from .tp import all_reduce_sum_


class _RenormRowsKL(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (loss_sum, kd_sum, ce_sum, student_mass_sum = NaN)."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch: KDBatch):
        dtype, tau = plan.dtype, plan.options.temperature
        num_tokens, k = batch.local_ids.shape
        hidden_size = hidden.shape[-1]
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = hidden.new_zeros(hidden.shape, dtype=dtype) if need_dx else None
        d_weight = weight.new_zeros(weight.shape, dtype=dtype) if need_dw else None
        totals = torch.zeros(3, dtype=dtype, device=hidden.device)
        step = plan.chunk_tokens(2 * k * hidden_size * torch.finfo(dtype).bits // 8)
        for start in range(0, num_tokens, step):
            rows = slice(start, min(start + step, num_tokens))
            ids, local = batch.local_ids[rows], batch.local_valid[rows]          # [c, K]
            x = hidden[rows].to(dtype)                                           # [c, H]
            rows_w = weight[ids].to(dtype)                                       # [c, K, H]
            g = torch.bmm(rows_w, x[:, :, None]).squeeze(-1) / tau               # [c, K]
            g = all_reduce_sum_(torch.where(local, g, g.new_zeros(())), plan.shard)
            weight_t = batch.weight[rows]
            terms = token_terms(TokenPartials(support_logits=g), batch.teacher.rows(rows), weight_t, plan.options)
            totals += torch.stack([(weight_t * terms.kd).sum(), weight_t.new_zeros(()),
                                   weight_t.new_tensor(torch.nan)])
            d_r = torch.where(local, terms.support_grad, g.new_zeros(()))       # [c, K] d loss / d (W x)
            if d_hidden is not None:
                d_hidden[rows] = torch.bmm(d_r[:, None, :], rows_w).squeeze(1)
            if d_weight is not None:
                d_weight.index_add_(0, ids.reshape(-1), (d_r[:, :, None] * x[:, None, :]).reshape(-1, hidden_size))
        ctx.grads, ctx.input_dtypes = (d_hidden, d_weight), (hidden.dtype, weight.dtype)
        loss_sum, kd_sum, ce_sum, mass_sum = loss_totals(plan, totals)
        ctx.mark_non_differentiable(kd_sum, ce_sum, mass_sum)
        return loss_sum, kd_sum, ce_sum, mass_sum

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("the renorm KD loss supports one backward per forward")
        (d_hidden, d_weight), ctx.grads = ctx.grads, None
        hidden_dtype, weight_dtype = ctx.input_dtypes
        return (finish_grad(d_hidden, grad_loss, hidden_dtype), finish_grad(d_weight, grad_loss, weight_dtype),
                None, None)


def renorm_rows_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum)."""
    return _RenormRowsKL.apply(hidden, weight, plan, batch)
