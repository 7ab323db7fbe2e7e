"""Knowledge-distillation losses of a student lm_head against a cached teacher: fused, vocab-parallel,
memory-bounded; no [T, V] logits.

    from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss
    result = topk_kd_loss(hidden, weight, TopKTeacher(teacher_ids, teacher_logprobs), loss_mask=mask,
                          tp_group=tp_group, tail="ghost")
    result.loss_sum.backward()      # also: result.num_tokens, result.report["kd loss"] = [sum, count], ...

The family (one chunk loop, two losses): ``token_math`` (the per-token math, written once), ``divergence``,
``teacher`` (the typed teachers and the teacher's buckets), ``tp`` (the vocab shard and its collectives),
``chunk_backends`` / ``chunk_loop`` (the per-chunk vocab work and the loop between the collectives), ``fused_head``
(the autograd Functions over X and W), and the members: ``topk_loss`` (any teacher given as K slots per token:
``topk_teacher``, ``sampled_teacher``; the ``renorm_rows`` fast path; ``references``: the Dense and Forward-chunked
baselines) and ``cross_tokenizer_loss``. ``step.kd_loss`` picks a member by the teacher's type.
"""

from .cross_tokenizer_loss import CrossTokenizerTeacher, cross_tokenizer_loss
from .options import KDLossOptions, KDLossResult
from .step import KDLossInputs, RowTeacher, kd_loss
from .sampled_teacher import SampledTeacher
from .teacher import tensor_map
from .topk_teacher import TopKTeacher
from .topk_loss import topk_kd_loss

__all__ = ["CrossTokenizerTeacher", "KDLossInputs", "KDLossOptions", "KDLossResult", "RowTeacher", "SampledTeacher", "TopKTeacher",
           "cross_tokenizer_loss", "kd_loss", "tensor_map", "topk_kd_loss"]
