"""Context parallelism for KD rows: every per-token tensor split the way megatron-core splits a batch for CP.

With ``model.context_parallel_size = cp > 1`` a row of S tokens is cut into 2·cp equal chunks and CP rank r keeps
chunks r and 2·cp−1−r (megatron-core's load-balanced split for causal attention,
``megatron.core.utils.get_batch_on_this_cp_rank``). A KD row's tensors are all batch-first with the sequence in
dim 1 — tokens, labels, loss_mask, position_ids [b, S]; teacher_ids, teacher_logprobs, teacher_sample_weights
[b, S, K] — so one call slices them alike, and the loss then runs on this rank's S/cp tokens only.

No collective over CP is needed in the loss: the lm_head weight is replicated over CP, so each rank's dW is
partial and DDP's gradient reduction over DP×CP sums it; the local ``(loss_sum, num_tokens)`` and report pairs
reach megatron's reduction over DP×CP once (``forward_step_calc_loss`` / Bridge's ``train_step``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.utils import get_batch_on_this_cp_rank


def check_cp_seq_length(seq_length: int, cp_size: int, *, what: str = "seq_length") -> None:
    """ValueError unless ``2·cp_size`` divides ``seq_length`` (megatron's load-balanced CP split needs it)."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ValueError(f"{what}={seq_length} is not a multiple of 2 * context_parallel_size = {2 * cp_size}: "
                         "context parallelism cuts each row into 2·cp equal chunks")


def slice_kd_batch_for_cp(batch: dict[str, torch.Tensor | None], cp_group) -> dict[str, torch.Tensor | None]:
    """This CP rank's part of a batch-first KD batch (None entries stay None); the batch itself when cp = 1.

    Shape: every tensor [b, S, ...] -> [b, S/cp, ...], positions {chunk r, chunk 2·cp−1−r} of 2·cp chunks.
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp_size == 1:
        return batch
    for key, value in batch.items():
        if value is not None:
            check_cp_seq_length(value.shape[1], cp_size, what=f"the sequence length of batch[{key!r}]")
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)
