"""Tensor parallelism of the loss, resolved once at the boundary: the vocab shard and the collectives.

A group of size 1 (or None) makes every collective a no-op and the hidden-state mapping the identity.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabShard:
    """This rank's slice [vocab_start, vocab_end) of a vocab of ``vocab_size`` rows split over ``size`` ranks."""

    group: object | None
    """The tensor-parallel process group (None: no TP)."""
    rank: int
    """This rank's index in the group."""
    size: int
    """Number of ranks in the group."""
    vocab_start: int
    """First global vocab id of this shard."""
    vocab_end: int
    """One past the last global vocab id of this shard."""
    vocab_size: int
    """V: all shards together, padded rows included."""


def resolve_shard(tp_group, per_partition_vocab: int) -> VocabShard:
    """The shard of a weight with ``per_partition_vocab`` rows on this rank of ``tp_group``."""
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    start, end = 0, per_partition_vocab
    if size > 1:
        from megatron.core.tensor_parallel.utils import VocabUtility

        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition_vocab, rank, size)
    return VocabShard(group=tp_group if size > 1 else None, rank=rank, size=size, vocab_start=start, vocab_end=end,
                      vocab_size=per_partition_vocab * size)


def all_reduce_max_(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """In-place MAX over the group (per-token scalars)."""
    if shard.group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=shard.group)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """In-place SUM over the group (per-token scalars and K-sized partials)."""
    if shard.group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=shard.group)
    return tensor


def hidden_to_tp_region(hidden: torch.Tensor, shard: VocabShard, sequence_parallel: bool) -> torch.Tensor:
    """hidden [s, b, H] (or its [s/tp, b, H] shard under sequence parallelism) -> the full [s, b, H] that every
    rank multiplies with its vocab shard. Backward all-reduces (or reduce-scatters) dX over the group."""
    if shard.group is None:
        return hidden
    from megatron.core.tensor_parallel import mappings

    if sequence_parallel:
        return mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                             group=shard.group)
    return mappings.copy_to_tensor_model_parallel_region(hidden, group=shard.group)


def shard_local(ids: torch.Tensor, valid: torch.Tensor, vocab_start: int,
                vocab_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids [...] -> (shard-local ids clamped into [0, V/tp), local_valid = valid and inside the shard)."""
    local = valid & (ids >= vocab_start) & (ids < vocab_end)
    return (ids - vocab_start).clamp(0, vocab_end - vocab_start - 1), local
