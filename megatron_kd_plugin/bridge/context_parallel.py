"""Context parallelism for KD rows: every per-token tensor split the way megatron-core splits a batch for CP.

With ``model.context_parallel_size = cp > 1`` a row of S tokens is cut into 2·cp equal chunks and CP rank r keeps
chunks r and 2·cp−1−r (megatron-core's load-balanced split for causal attention,
``megatron.core.utils.get_batch_on_this_cp_rank``). A KD row's tensors (``cache.KDRow``) are all batch-first with
the sequence in dim 1 — tokens, labels, loss_mask, position_ids [b, S]; the teacher's [b, S, K] — so one call slices
them alike, and the loss then runs on this rank's S/cp tokens only. (Cross-tokenizer rows, whose segments would be
split, are refused with CP before step one: ``cache.rows.cross_tokenizer_rows``.)

No collective over CP is needed in the loss: the lm_head weight is replicated over CP, so each rank's dW is
partial and DDP's gradient reduction over DP×CP sums it; the local ``(loss_sum, num_tokens)`` and report pairs
reach megatron's reduction over DP×CP once (``forward_step_calc_loss`` / Bridge's ``train_step``).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_kd_plugin.cache import KDRow
from megatron_kd_plugin.loss import tensor_map


def check_cp_seq_length(seq_length: int, cp_size: int, *, what: str = "seq_length") -> None:
    """ValueError unless ``2·cp_size`` divides ``seq_length`` (megatron's load-balanced CP split needs it)."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ValueError(f"{what}={seq_length} is not a multiple of 2 * context_parallel_size = {2 * cp_size}: "
                         "context parallelism cuts each row into 2·cp equal chunks")


def slice_kd_batch_for_cp(batch: KDRow, cp_group) -> KDRow:
    """This CP rank's part of a batch-first ``KDRow`` (None fields stay None); the batch itself when cp = 1.

    Shape: every tensor [b, S, ...] -> [b, S/cp, ...], positions {chunk r, chunk 2·cp−1−r} of 2·cp chunks.
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp_size == 1:
        return batch
    tensors = []
    tensor_map(lambda t: tensors.append(t) or t, batch)                     # every tensor, in field order
    for index, value in enumerate(tensors):
        check_cp_seq_length(value.shape[1], cp_size, what=f"the sequence length of the batch's tensor {index}")
    sliced = iter(get_batch_on_this_cp_rank({f"tensor {i}": t for i, t in enumerate(tensors)}, is_hybrid_cp=False,
                                            cp_group=cp_group).values())
    return tensor_map(lambda t: next(sliced), batch)
