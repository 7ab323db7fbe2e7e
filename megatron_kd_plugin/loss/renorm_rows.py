"""The ``renorm`` fast path: only the K rows W[I] of each token are needed, never the vocab.

With D the sparse [T, V/tp] matrix holding each token's K slots (CSR, the canonical sorted ids as columns):
g = (X W^T)[D's pattern] / tau (a sampled product, T*K*H), summed over the group, then ``token_terms`` gives
d loss / d (X W^T) at the slots, and dX = D W, dW = D^T X are sparse-dense products. Cost T*K*H instead of
T*V*H, memory O(T*K) beside dX and dW (no chunking needed); gradients are formed in forward.
"""

from __future__ import annotations

import warnings

import torch

from .main_grad import main_grad_of
from .plan import KDBatch, LossPlan, finish_grad, loss_totals
from .token_math import TokenPartials, token_terms
from .tp import all_reduce_sum_


def _slots(local_ids: torch.Tensor, values: torch.Tensor, vocab_local: int) -> torch.Tensor:
    """CSR [T, V/tp] with the K slots of each token (ids are sorted per token, so rows are sorted)."""
    num_tokens, k = local_ids.shape
    crow = torch.arange(0, num_tokens * k + 1, k, device=local_ids.device)
    with warnings.catch_warnings():                          # "sparse CSR support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, local_ids.reshape(-1).long(), values.reshape(-1),
                                       (num_tokens, vocab_local))


class _RenormRowsKL(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (loss_sum, kd_sum, ce_sum, student_mass_sum = NaN)."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch: KDBatch):
        dtype = plan.dtype
        x, w = hidden.to(dtype), weight.to(dtype)                            # [T, H], [V/tp, H]
        vocab_local = w.shape[0]
        local = batch.local_valid                                            # [T, K]
        if local.shape[1] > vocab_local:          # a CSR row may not hold more entries than columns: pad W (tiny)
            w = torch.cat([w, w.new_zeros(local.shape[1] - vocab_local, w.shape[1])])
            vocab_local = w.shape[0]
        pattern = _slots(batch.local_ids, torch.zeros(local.shape, dtype=dtype, device=x.device), vocab_local)
        g = torch.sparse.sampled_addmm(pattern, x, w.t()).values().view(local.shape) / plan.options.temperature
        g = all_reduce_sum_(torch.where(local, g, g.new_zeros(())), plan.shard)   # [T, K]
        terms = token_terms(TokenPartials(support_logits=g), batch.teacher, batch.weight, plan.options)
        d_slots = _slots(batch.local_ids, torch.where(local, terms.support_grad, g.new_zeros(())), vocab_local)
        d_hidden = torch.sparse.mm(d_slots, w) if ctx.needs_input_grad[0] else None     # [T, H]
        d_weight = None
        if ctx.needs_input_grad[1]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                d_weight = torch.sparse.mm(d_slots.t().to_sparse_csr(), x)[:weight.shape[0]]   # [V/tp, H]
        totals = torch.stack([(batch.weight * terms.kd).sum(), g.new_zeros(()), g.new_tensor(torch.nan)])
        ctx.grads, ctx.input_dtypes = (d_hidden, d_weight), (hidden.dtype, weight.dtype)
        ctx.main_grad = main_grad_of(weight, dtype, plan.accumulate_main_grad) if d_weight is not None else None
        return loss_totals(ctx, plan, totals)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("the renorm KD loss supports one backward per forward")
        (d_hidden, d_weight), ctx.grads = ctx.grads, None
        main_grad, ctx.main_grad = ctx.main_grad, None
        hidden_dtype, weight_dtype = ctx.input_dtypes
        if main_grad is not None:
            main_grad.buffer.add_(d_weight.mul_(grad_loss.to(d_weight.dtype)))
            weight_grad = main_grad.placeholder_grad()
        else:
            weight_grad = finish_grad(d_weight, grad_loss, weight_dtype)
        return finish_grad(d_hidden, grad_loss, hidden_dtype), weight_grad, None, None


def renorm_rows_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum)."""
    return _RenormRowsKL.apply(hidden, weight, plan, batch)
