"""Top-K knowledge-distillation loss against a cached teacher: fused, vocab-parallel, memory-bounded.

    from megatron_kd_plugin.loss import topk_kd_loss
    result = topk_kd_loss(hidden, weight, teacher_ids, teacher_logprobs, loss_mask=mask, tp_group=tp_group)
    result.loss_sum.backward()      # also: result.num_tokens, kd_sum, ce_sum, student/teacher top-K mass sums

The math: ``token_math``. Formulations: ``fused`` (default), ``forward_chunked`` and ``dense`` (references).
"""

from .api import topk_kd_loss
from .options import KDLossOptions, KDLossResult

__all__ = ["KDLossOptions", "KDLossResult", "topk_kd_loss"]
