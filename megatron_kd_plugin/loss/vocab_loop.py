"""The chunk loop over tokens shared by the fused and forward-chunked formulations.

Each chunk: raw logits r [c, V/tp] (from X_c W^T or from stored logits) -> MAX all-reduce of the row max ->
one SUM all-reduce of [E_tail, g (K), r_y, S1] -> ``token_terms`` -> optionally the logits gradient, handed to
``on_grad``. Recompute mode keeps the per-token coefficients instead and rebuilds the gradient in ``backward_pass``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .chunk_ops import exp_off_support_, gather_local, logits_grad_
from .plan import KDBatch, LossPlan
from .token_math import TokenPartials, TokenTerms, token_terms
from .tp import all_reduce_max_, all_reduce_sum_

LogitsChunk = Callable[[slice], torch.Tensor]        # rows -> writable fp32 raw logits [c, V/tp]
GradSink = Callable[[slice, torch.Tensor], None]     # (rows, d loss / d r [c, V/tp]) -> None


class SavedCoefs(NamedTuple):
    """Per-token numbers that rebuild a chunk's gradient from its recomputed logits (T*K, no vocab)."""

    row_max: torch.Tensor         # [T]
    dense_coef: torch.Tensor      # [T]
    support_grad: torch.Tensor    # [T, K]
    label_grad: torch.Tensor      # [T]
    ce_dense_coef: torch.Tensor | None  # [T]


def _chunks(plan: LossPlan, num_tokens: int, vocab_local: int, device: torch.device):
    step = plan.chunk_tokens(vocab_local * plan.vocab_buffers * torch.finfo(plan.dtype).bits // 8, device)
    return (slice(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step))


def _exp_buffers(z: torch.Tensor, row_max: torch.Tensor, plan: LossPlan, batch: KDBatch, rows: slice,
                 with_full: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z [c, V/tp] -> (E off the support, in place; E1 = exp(tau (z - M)) over the whole vocab if asked)."""
    full = ((z - row_max[:, None]) * plan.options.temperature).exp_() if with_full else None
    return exp_off_support_(z, row_max, batch.local_ids[rows], batch.local_valid[rows]), full


def _chunk_grad(exp_off, exp_full, plan: LossPlan, batch: KDBatch, rows: slice, dense_coef, support_grad,
                label_grad, ce_dense_coef) -> torch.Tensor:
    zero = exp_off.new_zeros(())
    local_label = label_grad_local = None
    if plan.with_labels:
        local_label = batch.local_label[rows]
        label_grad_local = torch.where(batch.label_local[rows], label_grad, zero)
    support_local = torch.where(batch.local_valid[rows], support_grad, zero)
    return logits_grad_(exp_off, dense_coef, batch.local_ids[rows], support_local, local_label, label_grad_local,
                        exp_full, ce_dense_coef)


def forward_pass(plan: LossPlan, batch: KDBatch, logits_chunk: LogitsChunk, on_grad: GradSink | None,
                 keep_coefs: bool) -> tuple[torch.Tensor, SavedCoefs | None]:
    """Loss totals [kd_sum, ce_sum, student_mass_sum] (weighted, unscaled) and, if ``keep_coefs``, the coefficients
    for ``backward_pass``. With ``on_grad`` each chunk's d loss_sum / d r goes to it during the pass."""
    options = plan.options
    tau = options.temperature
    num_tokens, k = batch.local_ids.shape
    with_full = plan.with_labels and tau != 1.0
    totals = torch.zeros(3, dtype=plan.dtype, device=batch.weight.device)
    saved = None
    if keep_coefs:
        t_vec = batch.weight.new_empty(num_tokens)
        saved = SavedCoefs(t_vec, torch.empty_like(t_vec), batch.weight.new_empty(num_tokens, k),
                           torch.empty_like(t_vec), torch.empty_like(t_vec) if with_full else None)
    vocab_local = plan.shard.vocab_end - plan.shard.vocab_start
    for rows in _chunks(plan, num_tokens, vocab_local, batch.weight.device):
        z = logits_chunk(rows)                                                # [c, V/tp] raw r
        if tau != 1.0:
            z.mul_(1.0 / tau)
        row_max = all_reduce_max_(z.amax(-1), plan.shard)                    # [c] M
        columns = [gather_local(z, batch.local_ids[rows], batch.local_valid[rows])]      # [c, K] g
        if plan.with_labels:
            columns.append(gather_local(z, batch.local_label[rows, None], batch.label_local[rows, None]) * tau)
        exp_off, exp_full = _exp_buffers(z, row_max, plan, batch, rows, with_full)
        if with_full:
            columns.append(exp_full.sum(-1, keepdim=True))
        columns.insert(0, exp_off.sum(-1, keepdim=True))
        packed = all_reduce_sum_(torch.cat(columns, -1), plan.shard)         # [c, 1 + K (+1) (+1)]
        extra = packed[:, 1 + k:].unbind(-1)
        partials = TokenPartials(support_logits=packed[:, 1:1 + k], row_max=row_max, tail_sum=packed[:, 0],
                                 label_logit=extra[0] if plan.with_labels else None,
                                 ce_sum_exp=extra[1] if with_full else None)
        weight = batch.weight[rows]
        terms: TokenTerms = token_terms(partials, batch.teacher.rows(rows), weight, options)
        counted = weight != 0
        totals += torch.stack([(weight * terms.kd).sum(), (weight * terms.ce).sum(),
                               torch.where(counted, terms.student_mass, terms.kd.new_zeros(())).sum()])
        if on_grad is not None:
            on_grad(rows, _chunk_grad(exp_off, exp_full, plan, batch, rows, terms.dense_coef, terms.support_grad,
                                      terms.label_grad, terms.ce_dense_coef))
        if saved is not None:
            saved.row_max[rows] = row_max
            saved.dense_coef[rows] = terms.dense_coef
            saved.support_grad[rows] = terms.support_grad
            saved.label_grad[rows] = terms.label_grad
            if with_full:
                saved.ce_dense_coef[rows] = terms.ce_dense_coef
    return totals, saved


def backward_pass(plan: LossPlan, batch: KDBatch, saved: SavedCoefs, grad_scale: torch.Tensor,
                  logits_chunk: LogitsChunk, on_grad: GradSink) -> None:
    """Recompute each chunk's logits and hand grad_scale * d loss_sum / d r to ``on_grad``; no collectives."""
    tau = plan.options.temperature
    with_full = saved.ce_dense_coef is not None
    vocab_local = plan.shard.vocab_end - plan.shard.vocab_start
    for rows in _chunks(plan, batch.local_ids.shape[0], vocab_local, batch.weight.device):
        z = logits_chunk(rows)
        if tau != 1.0:
            z.mul_(1.0 / tau)
        exp_off, exp_full = _exp_buffers(z, saved.row_max[rows], plan, batch, rows, with_full)
        on_grad(rows, _chunk_grad(exp_off, exp_full, plan, batch, rows, saved.dense_coef[rows] * grad_scale,
                                  saved.support_grad[rows] * grad_scale, saved.label_grad[rows] * grad_scale,
                                  saved.ce_dense_coef[rows] * grad_scale if with_full else None))
