"""The KD loss of one training step, looked up by the kind of teacher the rows carry (the one place that maps a
teacher type to its loss): what the KD forward step hands megatron-core's ``output_processor`` hook."""

from __future__ import annotations

import dataclasses

import torch

from .cross_tokenizer_loss import CrossTokenizerTeacher, cross_tokenizer_loss
from .options import KDLossOptions, KDLossResult
from .teacher import SampledTeacher, TopKTeacher
from .topk_loss import topk_kd_loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class KDLossInputs:
    """Everything a KD loss takes besides the final hidden states and the lm_head weight, in [s, b] order."""

    teacher: TopKTeacher | SampledTeacher | CrossTokenizerTeacher
    """The teacher's side of the rows ([s, b, ...]); its type picks the loss (``LOSSES``)."""
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


def _topk(hidden: torch.Tensor, weight: torch.Tensor, inputs: KDLossInputs) -> KDLossResult:
    """Top-K and sampled rows: the hard-label CE (and its ``lm loss`` figure) only when alpha < 1 mixes it in."""
    return topk_kd_loss(hidden, weight, inputs.teacher, loss_mask=inputs.loss_mask,
                        labels=inputs.labels if inputs.options.alpha < 1.0 else None, options=inputs.options,
                        tp_group=inputs.tp_group, sequence_parallel=inputs.sequence_parallel)


def _cross_tokenizer(hidden: torch.Tensor, weight: torch.Tensor, inputs: KDLossInputs) -> KDLossResult:
    return cross_tokenizer_loss(hidden, weight, inputs.teacher, labels=inputs.labels, loss_mask=inputs.loss_mask,
                                options=inputs.options, tp_group=inputs.tp_group,
                                sequence_parallel=inputs.sequence_parallel)


LOSSES = {TopKTeacher: _topk, SampledTeacher: _topk, CrossTokenizerTeacher: _cross_tokenizer}
"""Each teacher type's loss."""


def kd_loss(hidden: torch.Tensor, weight: torch.Tensor, inputs: KDLossInputs) -> KDLossResult:
    """hidden [s, b, H] (or its [s/tp, b, H] shard), weight [V/tp, H] -> the loss of ``inputs.teacher``'s kind."""
    loss = LOSSES.get(type(inputs.teacher))
    if loss is None:
        raise TypeError(f"no KD loss takes a {type(inputs.teacher).__name__} teacher; the teacher types are "
                        f"{[t.__name__ for t in LOSSES]}")
    return loss(hidden, weight, inputs)
