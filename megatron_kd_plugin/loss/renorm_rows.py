"""The ``renorm`` fast path: only the K rows W[I] of each token are needed, never the vocab.

Per token t with shard-local slot ids I_t [K]: g_t = W[I_t] x_t / tau (K dot products), summed over the TP group,
then ``token_terms`` gives d_t = d loss / d (X W^T) at the slots, and dX_t = d_t W[I_t], dW[I_t] += d_t x_t^T.
Cost T*K*H instead of T*V*H. The rows are gathered and cast to the accumulation dtype one chunk of tokens at a time
(``_token_chunks``: [c, K, H] within the chunk budget), so a bf16 [V/tp, H] weight is never copied whole, nor X;
memory is O(T*K) beside dX and dW. Gradients are formed in forward (two passes over the chunks: g, then dX / dW).
"""

from __future__ import annotations

import torch

from .chunk_loop import group_sums
from .loss_plan import KDBatch, LossPlan
from .fused_head import formed_grads, input_grads, loss_totals, main_grad_of
from .token_math import TokenPartials, token_terms
from .tp import all_reduce_sum_


def _token_chunks(plan: LossPlan, weight: torch.Tensor, num_tokens: int, k: int):
    """Slices of tokens whose gathered rows ([c, K, H] in the weight's dtype, two [c, K, H] in the accumulation
    dtype: the cast rows and the dW outer products) fit the chunk budget."""
    per_token = k * weight.shape[1] * (weight.element_size() + 2 * plan.dtype.itemsize)
    step = max(1, plan.options.budget_bytes(weight.device) // max(1, per_token))
    return (slice(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step))


def _support_rows(weight: torch.Tensor, local_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W[I] for a chunk: local_ids [c, K] -> [c, K, H] in ``dtype`` (only these rows are cast)."""
    return weight.index_select(0, local_ids.reshape(-1).long()).view(*local_ids.shape, -1).to(dtype)


def _add_rows_(target: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """target[ids[n]] += rows[n] for every n (ids [N], rows [N, H]), repeated ids summed in the same order every run
    on both devices: CUDA's ``index_put_(accumulate=True)`` sorts the ids first (its ``index_add_`` adds atomically);
    CPU's ``index_add_`` adds one index after another (its ``index_put_`` accumulate adds from several threads in no
    fixed order: two runs of a heal differed from the third step on)."""
    if target.is_cuda:
        target.index_put_((ids,), rows, accumulate=True)
    else:
        target.index_add_(0, ids, rows)


class _RenormRowsKL(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (loss_sum, kd_sum, ce_sum, student_mass_sum = NaN, group sums [G, 2])."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch: KDBatch):
        dtype = plan.dtype
        local = batch.local_valid                                            # [T, K]
        num_tokens, k = local.shape
        need_dx, need_dw = input_grads(ctx, plan)
        g = hidden.new_empty((num_tokens, k), dtype=dtype)                   # [T, K]
        for rows in _token_chunks(plan, weight, num_tokens, k):
            w_rows = _support_rows(weight, batch.local_ids[rows], dtype)     # [c, K, H]
            g[rows] = torch.bmm(w_rows, hidden[rows].to(dtype).unsqueeze(-1)).squeeze(-1)
        g = all_reduce_sum_(torch.where(local, g / plan.options.temperature, g.new_zeros(())), plan.shard)
        terms = token_terms(TokenPartials(support_logits=g), batch.teacher, batch.weight, plan.options)
        d_hidden = hidden.new_empty(hidden.shape, dtype=dtype) if need_dx else None     # [T, H]
        d_weight = weight.new_zeros(weight.shape, dtype=dtype) if need_dw else None     # [V/tp, H]
        if need_dx or need_dw:
            d_slots = torch.where(local, terms.support_grad, g.new_zeros(()))          # [T, K]
            for rows in _token_chunks(plan, weight, num_tokens, k):
                ids, d = batch.local_ids[rows], d_slots[rows]                          # [c, K]
                if need_dx:
                    d_hidden[rows] = torch.bmm(d.unsqueeze(1), _support_rows(weight, ids, dtype)).squeeze(1)
                if need_dw:
                    x = hidden[rows].to(dtype)                                         # [c, H]
                    _add_rows_(d_weight, ids.reshape(-1).long(), (d.unsqueeze(-1) * x.unsqueeze(1)).flatten(0, 1))
        weighted_kd = batch.weight * terms.kd
        totals = torch.cat([torch.stack([weighted_kd.sum(), g.new_zeros(()), g.new_tensor(torch.nan)]),
                            group_sums(plan.num_groups, batch.group, (weighted_kd, torch.zeros_like(weighted_kd)))])
        ctx.grads, ctx.input_dtypes = (d_hidden, d_weight), (hidden.dtype, weight.dtype)
        ctx.main_grad = main_grad_of(weight, dtype, plan.accumulate_main_grad) if d_weight is not None else None
        return loss_totals(ctx, plan, totals)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return *formed_grads(ctx, grad_loss, "the renorm KD loss"), None, None


def renorm_rows_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum, group
    sums [G, 2])."""
    return _RenormRowsKL.apply(hidden, weight, plan, batch)
