"""The chunk loop over tokens that every vocab-sized formulation shares (fused, forward-chunked, the cross-tokenizer
loss's token terms), and what it receives: one frozen plan (options + TP shard + chunk size) and the per-token batch.

Each chunk: raw logits r [c, V/tp] (from X_c W^T or from stored logits) -> MAX all-reduce of the row max ->
one SUM all-reduce of [E_tail, g (K), r_y, S1, S1_tail] -> ``token_terms`` -> optionally the logits gradient, handed
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
from .options import KDLossOptions
from .teacher import SlotTeacher, TeacherBuckets, tensor_map
from .token_math import TokenPartials, token_terms
from .tp import VocabShard, all_reduce_max_, all_reduce_sum_, shard_local


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossPlan:
    """Everything about a call that is not a tensor."""

    options: KDLossOptions
    """The loss options."""
    shard: VocabShard
    """This rank's vocab shard and TP group."""
    dtype: torch.dtype
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    with_labels: bool
    """Whether the CE term is formed."""
    triton: bool = False
    """Fused loss: the chunks go through the Triton kernels (``options.kernels`` resolved by ``use_triton_kernels``)."""
    logits_dtype: torch.dtype | None = None
    """dtype of the [c, V/tp] logits chunk (the chunk GEMM's output); None: ``dtype``."""
    accumulate_main_grad: bool = False
    """Fused loss: accumulate dW into the weight's ``main_grad`` (megatron-core DDP's buffer) when it has one of the
    accumulation dtype, instead of returning it (``main_grad.py``)."""
    grad_enabled: bool = True
    """``torch.is_grad_enabled()`` at the call. Off (``torch.no_grad()``, Bridge's evaluation loop) the Functions
    form no gradient and keep no per-token state (``input_grads``)."""
    num_groups: int = 0
    """G > 0: the tokens fall into G report groups (``KDBatch.group``, a blend's sources) and the totals carry each
    group's weighted KD and CE sums after the call's own (``group_sums``)."""

    @property
    def ce_needs_unit_softmax(self) -> bool:
        """CE is formed at tau != 1: its softmax(r) needs the untempered sum S1 (``token_math``)."""
        return self.with_labels and self.options.temperature != 1.0

    @property
    def tail_needs_student_shape(self) -> bool:
        """The ghost tail at tau != 1: the teacher's tail bucket is tempered with the student's tail shape, which
        needs the untempered off-support sum S1_tail (``token_math``)."""
        return self.options.tail == "ghost" and self.options.temperature != 1.0

    def chunk_tokens(self, vocab_local: int, device: torch.device) -> int:
        """Tokens per chunk so that the chunk's [c, V/tp] working buffers fit the byte budget (at least 1): the
        logits chunk (Triton: in ``logits_dtype``, gradient written in place), or E plus E1 = exp(r - tau M) for
        CE or the ghost tail at tau != 1 (PyTorch: in ``dtype``)."""
        if self.triton:
            bytes_per_token = vocab_local * (self.logits_dtype or self.dtype).itemsize
        else:
            buffers = 2 if self.ce_needs_unit_softmax or self.tail_needs_student_shape else 1
            bytes_per_token = vocab_local * buffers * self.dtype.itemsize
        return max(1, self.options.budget_bytes(device) // max(1, bytes_per_token))


def use_triton_kernels(kernels: str, hidden: torch.Tensor) -> bool:
    """Resolve ``KDLossOptions.kernels`` for inputs like ``hidden``; ValueError where ``triton`` cannot run."""
    from megatron_kd_plugin.kernels import use_triton

    if hidden.dtype == torch.float64:
        if kernels == "triton":
            raise ValueError("kernels='triton' with float64 inputs: the kernels compute in fp32; use "
                             "kernels='torch' (or 'auto') for float64")
        return False
    return use_triton(hidden, kernels)


class KDBatch(NamedTuple):
    """Per-token inputs, flattened to T = s * b tokens in [s, b] order: what the loss keeps for the whole call
    (~10 bytes per teacher slot: int32 local id, the bucket log-prob, two bools)."""

    teacher: TeacherBuckets      # [T, K]
    local_ids: torch.Tensor      # [T, K] int32 shard-local ids (clamped), the teacher's sorted slot order
    local_valid: torch.Tensor    # [T, K] bool: a bucket whose id lies in this shard
    weight: torch.Tensor         # [T] loss_mask in the accumulation dtype
    local_label: torch.Tensor | None   # [T] int64 shard-local label (clamped)
    label_local: torch.Tensor | None   # [T] bool: the label lies in this shard
    has_label: torch.Tensor | None     # [T] bool: the label is not IGNORE_INDEX (it has a CE term)
    group: torch.Tensor | None = None  # [T] int64 report group of each token (``LossPlan.num_groups`` > 0)


IGNORE_INDEX = -100
"""A label equal to this (Hugging Face's and PyTorch's ``ignore_index``) has no CE term; the token's KD term counts."""


def prepare_batch(plan: LossPlan, teacher: SlotTeacher, loss_mask: torch.Tensor,
                  labels: torch.Tensor | None, groups: torch.Tensor | None = None) -> KDBatch:
    """[s, b, K] (or [T, K]) teacher and [s, b] inputs (``groups``: each token's report group, with
    ``plan.num_groups`` > 0) -> the flattened per-token batch (T*K work, no vocab). The
    teacher's float64 math (``SlotTeacher.buckets``) runs over blocks of tokens (``_teacher_block_tokens``), so its
    temporaries stay within the chunk budget; its ids keep their dtype (a store's int32) up to the chunk backend."""
    t, k = loss_mask.numel(), teacher.ids.shape[-1]
    options, shard = plan.options, plan.shard
    flat = tensor_map(lambda x: x.reshape(t, k), teacher)                     # [T, K]
    step = _teacher_block_tokens(plan, k, flat.ids.device)
    blocks = []
    for start in range(0, max(t, 1), step):
        block = tensor_map(lambda x: x[start:start + step], flat)
        sorted_ids, buckets = block.buckets(tail=options.tail, temperature=options.temperature,
                                            vocab_size=shard.vocab_size)
        buckets = TeacherBuckets(*(x.to(plan.dtype) if x.is_floating_point() else x for x in buckets))
        local_ids, local_valid = shard_local(sorted_ids, buckets.valid, shard.vocab_start, shard.vocab_end)
        blocks.append((buckets, local_ids.to(torch.int32), local_valid))
    buckets = TeacherBuckets(*(torch.cat(parts) for parts in zip(*(block[0] for block in blocks), strict=True)))
    local_ids, local_valid = (torch.cat([block[i] for block in blocks]) for i in (1, 2))
    del blocks
    weight = loss_mask.reshape(-1).to(plan.dtype)
    local_label = label_local = has_label = None
    if labels is not None:
        flat_labels = labels.reshape(-1).long()
        has_label = flat_labels != IGNORE_INDEX
        local_label, label_local = shard_local(flat_labels, has_label, shard.vocab_start, shard.vocab_end)
    group = None if groups is None else groups.reshape(-1).long()
    return KDBatch(buckets, local_ids, local_valid, weight, local_label, label_local, has_label, group)


def group_sums(num_groups: int, group: torch.Tensor | None, weighted: tuple[torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
    """[G * 2]: per report group g < G = ``num_groups``, (sum of the weighted KD values, of the weighted CE values)
    of its tokens. group [c] int64 (None with G = 0: an empty tensor); weighted: w_t f_t and w_t CE_t [c]."""
    sums = weighted[0].new_zeros(num_groups, 2)
    if num_groups:
        sums.index_add_(0, group, torch.stack(weighted, dim=-1))
    return sums.reshape(-1)


def _teacher_block_tokens(plan: LossPlan, k: int, device: torch.device) -> int:
    """Tokens per block of the teacher's float64 math: ~16 float64 [tokens, K] temporaries within the chunk budget."""
    return max(1, plan.options.budget_bytes(device) // (16 * 8 * max(k, 1)))


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
    totals = torch.zeros(3 + 2 * plan.num_groups, dtype=plan.dtype, device=batch.weight.device)
    saved = None
    if keep_coefs:
        saved = SavedCoefs(batch.weight.new_empty(num_tokens), _coef_buffers(plan, batch),
                           _coef_buffers(plan, batch) if per_token is not None else None)
    for rows in _chunks(plan, num_tokens, batch.weight.device):
        chunk = backend.load(logits_chunk(rows), rows)                       # [c, V/tp] raw r
        row_max = all_reduce_max_(chunk.local_max(), plan.shard)             # [c] M
        packed = all_reduce_sum_(chunk.partial_sums(row_max), plan.shard)    # [c, 1 + K (+1) (+1) (+1)]
        extra = iter(packed[:, 1 + k:].unbind(-1))
        partials = TokenPartials(support_logits=packed[:, 1:1 + k], row_max=row_max, tail_sum=packed[:, 0],
                                 label_logit=next(extra) if plan.with_labels else None,
                                 ce_sum_exp=next(extra) if plan.ce_needs_unit_softmax else None,
                                 unit_tail_sum=next(extra) if plan.tail_needs_student_shape else None)
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
