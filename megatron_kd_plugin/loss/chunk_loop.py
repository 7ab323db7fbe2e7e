"""The chunk loop over tokens that every vocab-sized formulation shares (fused, forward-chunked, the cross-tokenizer
loss's token terms), over what it receives: one frozen plan (options + TP shard + chunk size) and the per-token batch
(``loss_plan.py``).

Each chunk: raw logits r [c, V/tp] (from X_c W^T or from stored logits) -> MAX all-reduce of the row max ->
one SUM all-reduce of [E_tail, g (K), r_y, S1, S1_tail] (``token_math.ReducedColumns``) -> ``token_terms`` -> optionally the logits gradient, handed
to ``on_grad``. Recompute mode keeps the per-token coefficients instead and rebuilds the gradient in
``backward_pass``. A per-token pass (``PerToken``) returns each token's KD and CE values instead of weighted sums, and
keeps the two terms' coefficients apart, so that backward can scale each term of each token by its own incoming
gradient. The per-chunk vocab work between the collectives is a backend's (``chunk_backends``: PyTorch or Triton).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from .chunk_backends import ChunkCoefs, chunk_backend
from .loss_plan import KDBatch, LossPlan
from .token_math import token_terms
from .tp import all_reduce_max_, all_reduce_sum_


def group_sums(num_groups: int, group: torch.Tensor | None, weighted: tuple[torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
    """[G * 2]: per report group g < G = ``num_groups``, (sum of the weighted KD values, of the weighted CE values)
    of its tokens. group [c] int64 (None with G = 0: an empty tensor); weighted: w_t f_t and w_t CE_t [c]."""
    sums = weighted[0].new_zeros(num_groups, 2)
    if num_groups:
        sums.index_add_(0, group, torch.stack(weighted, dim=-1))
    return sums.reshape(-1)


LogitsChunk = Callable[[slice], torch.Tensor]        # rows -> writable raw logits [c, V/tp]
GradSink = Callable[[slice, torch.Tensor], None]     # (rows, d loss / d r [c, V/tp]) -> None


class SavedCoefs(NamedTuple):
    """Per-token numbers that rebuild a chunk's gradient from its recomputed logits (T*K, no vocab)."""

    row_max: torch.Tensor         # [T] M
    coefs: ChunkCoefs             # [T], [T, K], [T], [T]; a per-token pass: the KD term's alone
    ce_coefs: ChunkCoefs | None = None   # a per-token pass: the CE term's (d CE_t / d r), else None


class PerToken(NamedTuple):
    """Buffers a per-token pass fills, chunk by chunk: unweighted per-token values, alpha and the loss_mask not
    applied (the batch's weights are 1 where a term is formed)."""

    ce: torch.Tensor              # [T] L1 - r_y (0 where the label is IGNORE_INDEX)
    kd: torch.Tensor              # [T] tau^2 f (0 where the token has no teacher bucket)


def _chunks(plan: LossPlan, num_tokens: int, device: torch.device):
    step = plan.chunk_tokens(plan.shard.vocab_end - plan.shard.vocab_start, device)
    return (slice(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step))


def _coef_buffers(plan: LossPlan, batch: KDBatch) -> ChunkCoefs:
    num_tokens, k = batch.local_ids.shape
    t_vec = batch.weight.new_empty(num_tokens)
    return ChunkCoefs(torch.empty_like(t_vec), batch.weight.new_empty(num_tokens, k),
                      torch.empty_like(t_vec) if plan.with_labels else None,
                      torch.empty_like(t_vec) if plan.with_labels and plan.options.temperature != 1.0 else None)


def forward_pass(plan: LossPlan, batch: KDBatch, logits_chunk: LogitsChunk, on_grad: GradSink | None,
                 keep_coefs: bool, per_token: PerToken | None = None) -> tuple[torch.Tensor, SavedCoefs | None]:
    """Loss totals [kd_sum, ce_sum, student_mass_sum, then each report group's kd and ce sums] (weighted, unscaled;
    ``group_sums``) and, if ``keep_coefs``, the coefficients
    for ``backward_pass``. With ``on_grad`` each chunk's d loss_sum / d r goes to it during the pass. With
    ``per_token`` (recompute only, labels formed) the pass fills its per-token values, and the saved coefficients
    are the KD term's (alpha = 1) and the CE term's (alpha = 0) apart."""
    options = plan.options
    num_tokens, k = batch.local_ids.shape
    if per_token is not None and (on_grad is not None or not plan.with_labels):
        raise ValueError("a per-token pass needs labels and keeps coefficients (no gradient during forward)")
    kd_options = options if per_token is None else dataclasses.replace(options, alpha=1.0)
    ce_options = dataclasses.replace(options, alpha=0.0) if per_token is not None and keep_coefs else None
    backend = chunk_backend(plan, batch)
    columns = plan.reduced_columns(k)
    totals = torch.zeros(3 + 2 * plan.num_groups, dtype=plan.dtype, device=batch.weight.device)
    saved = None
    if keep_coefs:
        saved = SavedCoefs(batch.weight.new_empty(num_tokens), _coef_buffers(plan, batch),
                           _coef_buffers(plan, batch) if per_token is not None else None)
    for rows in _chunks(plan, num_tokens, batch.weight.device):
        chunk = backend.load(logits_chunk(rows), rows)                       # [c, V/tp] raw r
        row_max = all_reduce_max_(chunk.local_max(), plan.shard)             # [c] M
        packed = all_reduce_sum_(chunk.partial_sums(row_max), plan.shard)    # [c, width]
        partials = columns.unpack(packed, row_max)
        weight, teacher = batch.weight[rows], batch.teacher.rows(rows)
        has_label = None if batch.has_label is None else batch.has_label[rows]
        terms = token_terms(partials, teacher, weight, kd_options, has_label)
        counted = weight != 0
        if per_token is not None:
            per_token.ce[rows] = terms.ce
            per_token.kd[rows] = terms.kd * options.temperature ** 2
        weighted = (weight * terms.kd, weight * terms.ce)
        totals += torch.cat([torch.stack([weighted[0].sum(), weighted[1].sum(),
                                          torch.where(counted, terms.student_mass, terms.kd.new_zeros(())).sum()]),
                             group_sums(plan.num_groups, None if batch.group is None else batch.group[rows], weighted)])
        if on_grad is not None or saved is not None:
            coefs = backend.coefs(rows, terms, partials)
            if on_grad is not None:
                on_grad(rows, chunk.logits_grad_(row_max, coefs))
            if saved is not None:
                saved.row_max[rows] = row_max
                parts = [(saved.coefs, coefs)]
                if ce_options is not None:                               # a per-token pass: the CE term's apart
                    ce_terms = token_terms(partials, teacher, weight, ce_options, has_label)
                    parts.append((saved.ce_coefs, backend.coefs(rows, ce_terms, partials)))
                for buffers, values in parts:
                    for buffer, value in zip(buffers, values, strict=True):
                        if buffer is not None:
                            buffer[rows] = value
        del chunk                                # freed before the next chunk's logits: one [c, V/tp] at a time
    return totals, saved


def backward_pass(plan: LossPlan, batch: KDBatch, saved: SavedCoefs, grad_scale: torch.Tensor,
                  logits_chunk: LogitsChunk, on_grad: GradSink, ce_scale: torch.Tensor | None = None) -> None:
    """Recompute each chunk's logits and hand grad_scale * d loss_sum / d r to ``on_grad``; no collectives.
    ``grad_scale``: a scalar, or one per token [T] (each token's coefficients scaled by its own). After a per-token
    pass ``grad_scale`` [T] scales the KD coefficients and ``ce_scale`` [T] the CE ones."""
    backend = chunk_backend(plan, batch)
    for rows in _chunks(plan, batch.local_ids.shape[0], batch.weight.device):
        chunk = backend.load(logits_chunk(rows), rows)
        coefs = saved.coefs.rows(rows).scaled(grad_scale[rows] if grad_scale.dim() else grad_scale)
        if ce_scale is not None:
            coefs = coefs.plus(saved.ce_coefs.rows(rows).scaled(ce_scale[rows]))
        on_grad(rows, chunk.logits_grad_(saved.row_max[rows], coefs))
        del chunk
