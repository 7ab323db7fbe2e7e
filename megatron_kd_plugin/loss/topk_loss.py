"""The top-K loss, of any teacher given as K slots per token (``teacher.SlotTeacher``: a store's top-K, top-p or
drawn ids): ``topk_kd_loss`` checks its inputs, resolves TP and dispatches to a formulation: the fused head (the
product), the renorm K-rows fast path, or a reference."""

from __future__ import annotations

import torch

from .loss_plan import LossPlan, prepare_batch, use_triton_kernels
from .fused_head import fused_topk_kl
from .options import KDLossOptions, KDLossResult
from .references import dense_topk_kl, forward_chunked_topk_kl
from .renorm_rows import renorm_rows_topk_kl
from .teacher import SlotTeacher, tensor_map
from .tp import hidden_to_tp_region, resolve_shard
from .validate import check_groups, check_shapes, check_values


def topk_kd_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher: SlotTeacher, *,
                 loss_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 options: KDLossOptions | None = None, tp_group=None, sequence_parallel: bool = False,
                 accumulate_main_grad: bool = True, groups: torch.Tensor | None = None,
                 group_names: tuple[str, ...] = (), **option_overrides) -> KDLossResult:
    """Top-K knowledge-distillation loss of a student lm_head against a cached teacher top-K, summed over tokens.

    Shapes: hidden [s, b, H] ([s/tp, b, H] with sequence_parallel), weight [V/tp, H] (this rank's vocab-parallel
    lm_head shard, padded rows included; the full vocab without TP), teacher [s, b, K]: a ``TopKTeacher`` (ids,
    log-probs over the teacher's full vocab, -inf marks a padding slot) or, with ``tail="sampled"``, a
    ``SampledTeacher`` (ids drawn from the teacher, repeats allowed, and their importance weights: the loss is then
    an unbiased estimate of the full-vocab forward KL); loss_mask [s, b] (token weights, 0 = ignored; default all
    ones), labels int [s, b] (global ids, -100 = no CE term for that token; needed iff alpha < 1; when given, CE is
    formed and reported). An empty batch (s = 0 or b = 0) gives zero sums and zero gradients.

    ``options`` (default ``KDLossOptions()``) with ``option_overrides`` (its field names: ``tail="renorm"``, ...)
    applied; the math is in ``megatron_kd_plugin.loss.token_math``. ``tail="renorm"`` without labels takes the
    K-rows fast path. Every TP rank returns the same sums (like megatron's vocab-parallel cross entropy); hidden's
    gradient is all-reduced (reduce-scattered with sequence_parallel) by megatron-core's mappings.
    ``accumulate_main_grad``: when the weight carries megatron-core DDP's fp32 ``main_grad``, the fused loss (and the
    renorm K-rows path) adds dW to it in fp32 and marks it added (``grad_added_to_main_grad``), as megatron's own
    layers do with gradient_accumulation_fusion, instead of returning a bf16 dW for DDP to add
    (``fused_head.MainGrad``); False always returns dW. The references ignore it.

    Reported figures (``KDLossResult.report``, ``[sum, count]`` over counted tokens): ``kd loss`` (the divergence
    without alpha * tau^2), ``lm loss`` (with labels), ``student top-K mass`` (s under the student at tau; NaN on
    the renorm K-rows path, which never forms the full-vocab normaliser) and ``teacher top-K mass`` (the untempered
    m; sampled: of the distinct drawn ids). With ``group_names`` (G names) and ``groups`` (int [s, b], each token's
    group in [0, G): a blend's sources), also ``kd loss [NAME]`` (and ``lm loss [NAME]`` with labels) per group:
    the same sums over the group's tokens alone (a pair [0, 0] when the batch holds none of them).
    """
    options = (options or KDLossOptions()).with_overrides(**option_overrides)
    shard = resolve_shard(tp_group, weight.shape[0])
    check_shapes(hidden, weight, teacher, loss_mask, labels, options, shard, sequence_parallel)
    check_groups(groups, group_names, teacher.ids.shape[:2])
    if loss_mask is None:
        loss_mask = torch.ones(teacher.ids.shape[:2], dtype=torch.float32, device=hidden.device)
    if options.validate:
        check_values(teacher, loss_mask, labels, options, shard.vocab_size, groups, len(group_names))
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    hidden = hidden_to_tp_region(hidden, shard, sequence_parallel)          # [s, b, H]
    hidden2d = hidden.reshape(-1, hidden.shape[-1])                          # [T, H]
    counted = loss_mask.reshape(-1) != 0
    flat_groups = None if groups is None or not group_names else groups.reshape(-1).long()
    num_groups = 0 if flat_groups is None else len(group_names)
    if options.impl == "dense":
        flat = tensor_map(lambda t: t.reshape(-1, t.shape[-1]), teacher)    # [T, K]
        mass = flat.mass()
        sums = dense_topk_kl(hidden2d, weight, flat, loss_mask.reshape(-1),
                             None if labels is None else labels.reshape(-1), options, shard, dtype, flat_groups,
                             num_groups)
    else:
        rows_path = options.tail == "renorm" and labels is None
        triton = options.impl == "fused" and not rows_path and use_triton_kernels(options.kernels, hidden2d)
        plan = LossPlan(options=options, shard=shard, dtype=dtype, with_labels=labels is not None, triton=triton,
                        logits_dtype=torch.promote_types(hidden.dtype, weight.dtype) if triton else None,
                        accumulate_main_grad=accumulate_main_grad, grad_enabled=torch.is_grad_enabled(),
                        num_groups=num_groups)
        batch = prepare_batch(plan, teacher, loss_mask, labels, flat_groups)
        mass = batch.teacher.mass
        if options.impl == "forward_chunked":
            sums = forward_chunked_topk_kl(hidden2d, weight, plan, batch)
        elif rows_path:
            sums = renorm_rows_topk_kl(hidden2d, weight, plan, batch)
        else:
            sums = fused_topk_kl(hidden2d, weight, plan, batch)
    loss_sum, kd_sum, ce_sum, student_mass_sum, by_group = sums
    num_tokens = torch.count_nonzero(counted).to(torch.int64)
    count = num_tokens.to(kd_sum.dtype)
    teacher_mass_sum = torch.where(counted, mass.to(dtype), 0.0).sum().detach()
    report = {"kd loss": torch.stack([kd_sum, count])}
    if labels is not None:
        report["lm loss"] = torch.stack([ce_sum, count])
    report["student top-K mass"] = torch.stack([student_mass_sum.detach(), count])
    report["teacher top-K mass"] = torch.stack([teacher_mass_sum, count])
    if num_groups:
        counts = by_group.new_zeros(num_groups).index_add_(0, flat_groups, counted.to(by_group.dtype))   # [G]
        for group, name in enumerate(group_names):
            report[f"kd loss [{name}]"] = torch.stack([by_group[group, 0], counts[group]])
            if labels is not None:
                report[f"lm loss [{name}]"] = torch.stack([by_group[group, 1], counts[group]])
    return KDLossResult(loss_sum, num_tokens, report)
