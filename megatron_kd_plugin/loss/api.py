"""``topk_kd_loss``: the one public entry point; checks inputs, resolves TP, dispatches to a formulation."""

from __future__ import annotations

import torch

from .dense import dense_topk_kl
from .forward_chunked import forward_chunked_topk_kl
from .fused import fused_topk_kl
from .options import KDLossOptions, KDLossResult
from .plan import LossPlan, prepare_batch, use_triton_kernels
from .renorm_rows import renorm_rows_topk_kl
from .teacher import teacher_mass
from .tp import hidden_to_tp_region, resolve_shard
from .validate import check_shapes, check_values


def topk_kd_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_ids: torch.Tensor,
                 teacher_logprobs: torch.Tensor, *, loss_mask: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, tail: str = "ghost", divergence: str = "forward_kl",
                 jsd_beta: float = 0.5, temperature: float = 1.0, alpha: float = 1.0, impl: str = "fused",
                 mode: str = "recompute", kernels: str = "auto", chunk_bytes: int | None = None, tp_group=None,
                 sequence_parallel: bool = False, validate: bool = True, mass_tolerance: float = 1e-2,
                 sample_weights: torch.Tensor | None = None, accumulate_main_grad: bool = True) -> KDLossResult:
    """Top-K knowledge-distillation loss of a student lm_head against a cached teacher top-K, summed over tokens.

    Shapes: hidden [s, b, H] ([s/tp, b, H] with sequence_parallel), weight [V/tp, H] (this rank's vocab-parallel
    lm_head shard, padded rows included; the full vocab without TP), teacher_ids int [s, b, K] global ids,
    teacher_logprobs float [s, b, K] (log-probs over the teacher's full vocab; -inf marks a padding slot),
    loss_mask [s, b] (token weights, 0 = ignored; default all ones), labels int [s, b] (global ids, -100 = no CE
    term for that token; needed iff alpha < 1; when given, CE is formed and reported), sample_weights float
    [s, b, K] (required iff tail="sampled": the slots are ids drawn from the teacher, repeats allowed, and
    sample_weights their importance weights; the loss is then an unbiased estimate of the full-vocab forward KL).
    An empty batch (s = 0 or b = 0) gives zero sums and zero gradients. The options are those of
    ``KDLossOptions``; the math is in ``megatron_kd_plugin.loss.token_math``. ``tail="renorm"`` without labels
    takes the K-rows fast path.
    ``kernels`` picks the fused loss's per-chunk backend (Triton kernels or PyTorch; see ``KDLossOptions``).
    Every TP rank returns the same sums (like megatron's vocab-parallel cross entropy); hidden's gradient is
    all-reduced (reduce-scattered with sequence_parallel) by megatron-core's mappings.
    ``accumulate_main_grad``: when the weight carries megatron-core DDP's fp32 ``main_grad``, the fused loss (and the
    renorm K-rows path) adds dW to it in fp32 and marks it added (``grad_added_to_main_grad``), as megatron's own
    layers do with gradient_accumulation_fusion, instead of returning a bf16 dW for DDP to add
    (``megatron_kd_plugin.loss.main_grad``); False always returns dW. The references ignore it.
    """
    options = KDLossOptions(tail=tail, divergence=divergence, jsd_beta=jsd_beta, temperature=temperature,
                            alpha=alpha, impl=impl, mode=mode, kernels=kernels, chunk_bytes=chunk_bytes,
                            validate=validate, mass_tolerance=mass_tolerance)
    shard = resolve_shard(tp_group, weight.shape[0])
    check_shapes(hidden, weight, teacher_ids, teacher_logprobs, loss_mask, labels, sample_weights, options, shard,
                 sequence_parallel)
    if loss_mask is None:
        loss_mask = torch.ones(teacher_ids.shape[:2], dtype=torch.float32, device=hidden.device)
    if options.validate:
        check_values(teacher_ids, teacher_logprobs, loss_mask, labels, sample_weights, options, shard.vocab_size)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    hidden = hidden_to_tp_region(hidden, shard, sequence_parallel)          # [s, b, H]
    hidden2d = hidden.reshape(-1, hidden.shape[-1])                          # [T, H]
    k = teacher_ids.shape[-1]
    num_tokens = torch.count_nonzero(loss_mask).to(torch.int64)
    flat_weights = None if sample_weights is None else sample_weights.reshape(-1, k)
    mass = teacher_mass(teacher_ids.reshape(-1, k), teacher_logprobs.reshape(-1, k).double(), flat_weights).to(dtype)
    teacher_mass_sum = torch.where(loss_mask.reshape(-1) != 0, mass, 0.0).sum()
    if options.impl == "dense":
        sums = dense_topk_kl(hidden2d, weight, teacher_ids.reshape(-1, k), teacher_logprobs.reshape(-1, k),
                             loss_mask.reshape(-1), None if labels is None else labels.reshape(-1), options, shard,
                             dtype, flat_weights)
    else:
        rows_path = options.tail == "renorm" and labels is None
        triton = options.impl == "fused" and not rows_path and use_triton_kernels(options.kernels, hidden2d)
        plan = LossPlan(options=options, shard=shard, dtype=dtype, with_labels=labels is not None, triton=triton,
                        logits_dtype=torch.promote_types(hidden.dtype, weight.dtype) if triton else None,
                        accumulate_main_grad=accumulate_main_grad, grad_enabled=torch.is_grad_enabled())
        batch = prepare_batch(plan, teacher_ids, teacher_logprobs, loss_mask, labels, sample_weights)
        if options.impl == "forward_chunked":
            sums = forward_chunked_topk_kl(hidden2d, weight, plan, batch)
        elif rows_path:
            sums = renorm_rows_topk_kl(hidden2d, weight, plan, batch)
        else:
            sums = fused_topk_kl(hidden2d, weight, plan, batch)
    loss_sum, kd_sum, ce_sum, mass_sum = sums
    return KDLossResult(loss_sum, num_tokens, kd_sum, ce_sum, mass_sum, teacher_mass_sum.detach())
