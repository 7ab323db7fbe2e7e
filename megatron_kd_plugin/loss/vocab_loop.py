"""The chunk loop over tokens shared by the fused and forward-chunked formulations.

Each chunk: raw logits r [c, V/tp] (from X_c W^T or from stored logits) -> MAX all-reduce of the row max ->
one SUM all-reduce of [E_tail, g (K), r_y, S1] -> ``token_terms`` -> optionally the logits gradient, handed to
``on_grad``. Recompute mode keeps the per-token coefficients instead and rebuilds the gradient in ``backward_pass``.
The per-chunk vocab work between the collectives is a backend's (``chunk_backends``: PyTorch or Triton).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .chunk_backends import ChunkCoefs, chunk_backend
from .plan import KDBatch, LossPlan
from .token_math import TokenPartials, TokenTerms, token_terms
from .tp import all_reduce_max_, all_reduce_sum_

LogitsChunk = Callable[[slice], torch.Tensor]        # rows -> writable raw logits [c, V/tp]
GradSink = Callable[[slice, torch.Tensor], None]     # (rows, d loss / d r [c, V/tp]) -> None


class SavedCoefs(NamedTuple):
    """Per-token numbers that rebuild a chunk's gradient from its recomputed logits (T*K, no vocab)."""

    row_max: torch.Tensor         # [T] M
    coefs: ChunkCoefs             # [T], [T, K], [T], [T]


def _chunks(plan: LossPlan, num_tokens: int, device: torch.device):
    step = plan.chunk_tokens(plan.shard.vocab_end - plan.shard.vocab_start, device)
    return (slice(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step))


def forward_pass(plan: LossPlan, batch: KDBatch, logits_chunk: LogitsChunk, on_grad: GradSink | None,
                 keep_coefs: bool, token_ce: torch.Tensor | None = None) -> tuple[torch.Tensor, SavedCoefs | None]:
    """Loss totals [kd_sum, ce_sum, student_mass_sum] (weighted, unscaled) and, if ``keep_coefs``, the coefficients
    for ``backward_pass``. With ``on_grad`` each chunk's d loss_sum / d r goes to it during the pass; ``token_ce``
    [T] receives each token's unweighted CE L1 - r_y (``TokenTerms.ce``)."""
    options = plan.options
    num_tokens, k = batch.local_ids.shape
    with_full = plan.with_labels and options.temperature != 1.0
    backend = chunk_backend(plan, batch)
    totals = torch.zeros(3, dtype=plan.dtype, device=batch.weight.device)
    saved = None
    if keep_coefs:
        t_vec = batch.weight.new_empty(num_tokens)
        saved = SavedCoefs(t_vec, ChunkCoefs(torch.empty_like(t_vec), batch.weight.new_empty(num_tokens, k),
                                             torch.empty_like(t_vec) if plan.with_labels else None,
                                             torch.empty_like(t_vec) if with_full else None))
    for rows in _chunks(plan, num_tokens, batch.weight.device):
        chunk = backend.load(logits_chunk(rows), rows)                       # [c, V/tp] raw r
        row_max = all_reduce_max_(chunk.local_max(), plan.shard)             # [c] M
        packed = all_reduce_sum_(chunk.partial_sums(row_max), plan.shard)    # [c, 1 + K (+1) (+1)]
        extra = packed[:, 1 + k:].unbind(-1)
        partials = TokenPartials(support_logits=packed[:, 1:1 + k], row_max=row_max, tail_sum=packed[:, 0],
                                 label_logit=extra[0] if plan.with_labels else None,
                                 ce_sum_exp=extra[1] if with_full else None)
        weight = batch.weight[rows]
        terms: TokenTerms = token_terms(partials, batch.teacher.rows(rows), weight, options,
                                        None if batch.has_label is None else batch.has_label[rows])
        counted = weight != 0
        if token_ce is not None:
            token_ce[rows] = terms.ce
        totals += torch.stack([(weight * terms.kd).sum(), (weight * terms.ce).sum(),
                               torch.where(counted, terms.student_mass, terms.kd.new_zeros(())).sum()])
        if on_grad is not None or saved is not None:
            coefs = backend.coefs(rows, terms, partials)
            if on_grad is not None:
                on_grad(rows, chunk.logits_grad_(row_max, coefs))
            if saved is not None:
                saved.row_max[rows] = row_max
                for buffer, value in zip(saved.coefs, coefs, strict=True):
                    if buffer is not None:
                        buffer[rows] = value
        del chunk                                # freed before the next chunk's logits: one [c, V/tp] at a time
    return totals, saved


def backward_pass(plan: LossPlan, batch: KDBatch, saved: SavedCoefs, grad_scale: torch.Tensor,
                  logits_chunk: LogitsChunk, on_grad: GradSink) -> None:
    """Recompute each chunk's logits and hand grad_scale * d loss_sum / d r to ``on_grad``; no collectives.
    ``grad_scale``: a scalar, or one per token [T] (each token's coefficients scaled by its own)."""
    backend = chunk_backend(plan, batch)
    for rows in _chunks(plan, batch.local_ids.shape[0], batch.weight.device):
        chunk = backend.load(logits_chunk(rows), rows)
        scale = grad_scale[rows] if grad_scale.dim() else grad_scale
        on_grad(rows, chunk.logits_grad_(saved.row_max[rows], saved.coefs.rows(rows).scaled(scale)))
        del chunk
