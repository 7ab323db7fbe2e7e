"""What a loss call hands the chunk loop (``chunk_loop``) and its chunk backends (``chunk_backends``): one frozen plan
(options, TP shard, dtypes, what is formed) and the per-token batch the teacher's slots become (T*K work, no vocab)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .options import KDLossOptions
from .teacher import SlotTeacher, TeacherBuckets, tensor_map
from .token_math import REDUCED_FIELDS, ReducedColumns
from .tp import VocabShard, shard_local


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

    def reduced_columns(self, k: int) -> ReducedColumns:
        """The layout of the chunk's SUM all-reduce for K teacher slots: E_tail and g always, r_y with labels, S1 for
        CE at tau != 1, S1_tail for the ghost tail at tau != 1."""
        formed = {"label_logit": self.with_labels, "ce_sum_exp": self.ce_needs_unit_softmax,
                  "unit_tail_sum": self.tail_needs_student_shape}
        return ReducedColumns(tuple(name for name in REDUCED_FIELDS if formed.get(name, True)), k)

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


def _teacher_block_tokens(plan: LossPlan, k: int, device: torch.device) -> int:
    """Tokens per block of the teacher's float64 math: ~16 float64 [tokens, K] temporaries within the chunk budget."""
    return max(1, plan.options.budget_bytes(device) // (16 * 8 * max(k, 1)))
