"""The KD loss of one training step, looked up by the kind of teacher the rows carry (the one place that maps a
teacher type to its loss): what the KD forward step hands megatron-core's ``output_processor`` hook."""

from __future__ import annotations

import dataclasses

import torch

from .cross_tokenizer_loss import CrossTokenizerTeacher, cross_tokenizer_loss
from .options import KDLossOptions, KDLossResult
from .sampled_teacher import SampledTeacher
from .topk_teacher import TopKTeacher
from .topk_loss import topk_kd_loss

RowTeacher = TopKTeacher | SampledTeacher | CrossTokenizerTeacher
"""The teacher side of a training row: every kind a store's rows carry (``cache.rows.kd_rows.KDRow.teacher``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KDLossInputs:
    """Everything a KD loss takes besides the final hidden states and the lm_head weight, in [s, b] order."""

    teacher: RowTeacher
    """The teacher's side of the rows ([s, b, ...]); its type picks the loss (``kd_loss``)."""
    labels: torch.Tensor
    """[s, b] int: the token each position predicts."""
    loss_mask: torch.Tensor
    """[s, b] float: token weights, 0 = not counted."""
    options: KDLossOptions
    """The run's loss options (``cfg.kd``)."""
    tp_group: object = None
    """The tensor-parallel group of the lm_head shard (None: no TP)."""
    sequence_parallel: bool = False
    """hidden arrives as this rank's [s/tp, b, H] sequence shard."""
    groups: torch.Tensor | None = None
    """[s, b] int: each token's report group (a blend's source store), or None."""
    group_names: tuple[str, ...] = ()
    """The groups' names: the report then also holds ``kd loss [NAME]`` (and ``lm loss [NAME]``) per group."""


def kd_loss(hidden: torch.Tensor, weight: torch.Tensor, inputs: KDLossInputs) -> KDLossResult:
    """hidden [s, b, H] (or its [s/tp, b, H] shard), weight [V/tp, H] -> the loss of ``inputs.teacher``'s kind. Top-K
    and sampled rows form the hard-label CE (and report ``lm loss``) only when alpha < 1 mixes it in."""
    teacher, options = inputs.teacher, inputs.options
    common = dict(loss_mask=inputs.loss_mask, options=options, tp_group=inputs.tp_group,
                  sequence_parallel=inputs.sequence_parallel)
    if isinstance(teacher, CrossTokenizerTeacher):
        if inputs.group_names:
            raise ValueError(f"report groups {inputs.group_names} with cross-tokenizer rows: that loss reports one "
                             "group (a cross-tokenizer student reads one store)")
        return cross_tokenizer_loss(hidden, weight, teacher, labels=inputs.labels, **common)
    if isinstance(teacher, (TopKTeacher, SampledTeacher)):
        return topk_kd_loss(hidden, weight, teacher, labels=inputs.labels if options.alpha < 1.0 else None,
                            groups=inputs.groups if inputs.group_names else None, group_names=inputs.group_names,
                            **common)
    raise TypeError(f"no KD loss takes a {type(teacher).__name__} teacher")
