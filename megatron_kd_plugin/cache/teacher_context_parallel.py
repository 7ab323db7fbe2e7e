"""Context parallelism for the teacher cache: each CP rank runs the teacher on its slice of every window and the fused
head on that slice; the writer reassembles the rows in position order.

The slicing is megatron-core's load-balanced split for causal attention (``get_batch_on_this_cp_rank``, the student's
too: ``bridge/context_parallel.py``): a window of s tokens is cut into 2·cp chunks of c = s/(2·cp) and CP rank r keeps
chunks r and 2·cp−1−r, in that order, so its slice is ``[2c]`` positions::

    slice rows [0, c)   <- positions [r·c, (r+1)·c)
    slice rows [c, 2c)  <- positions [(2·cp−1−r)·c, (2·cp−r)·c)

The head's blocks never straddle the two chunks (:func:`rank_chunks`), so a kind's draws take the uniforms of their
global positions; the rows are all-gathered over the CP group (K slots per token, no vocabulary) and put back in
position order (:func:`gather_rows`). Attention itself under CP needs Transformer Engine (megatron-core's local
attention refuses it), so the model's CP forward runs only on GPU.

Shapes: tokens ``[b, s]`` -> ``[b, s/cp]``; rows ``[s/cp, b, ...]`` -> ``[s, b, ...]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_size_of(cp_group) -> int:
    return 1 if cp_group is None else dist.get_world_size(cp_group)


def check_cp_seq_length(seq_length: int, cp_size: int) -> None:
    """ValueError, in one line naming the flags, unless ``2·cp_size`` divides ``seq_length``."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ValueError(f"--seq-length={seq_length} is not a multiple of 2 x --cp = {2 * cp_size}: context "
                         "parallelism cuts each window into 2·cp equal chunks")


def rank_chunks(seq_length: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int, int], ...]:
    """((slice start, position start, length), ...) of CP rank ``cp_rank``'s two chunks (module docstring); one chunk
    of the whole window without CP."""
    if cp_size == 1:
        return ((0, 0, seq_length),)
    c = seq_length // (2 * cp_size)
    return (0, cp_rank * c, c), (c, (2 * cp_size - 1 - cp_rank) * c, c)


def slice_tokens(tokens: torch.Tensor, cp_group) -> torch.Tensor:
    """This CP rank's slice ``[b, s/cp]`` of tokens ``[b, s]`` (megatron-core's ``get_batch_on_this_cp_rank``)."""
    if cp_size_of(cp_group) == 1:
        return tokens
    from megatron.core.utils import get_batch_on_this_cp_rank

    check_cp_seq_length(tokens.shape[1], cp_size_of(cp_group))
    return get_batch_on_this_cp_rank({"tokens": tokens}, is_hybrid_cp=False, cp_group=cp_group)["tokens"]


def gather_rows(rows: dict[str, torch.Tensor], finite: torch.Tensor, cp_group
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every CP rank's rows ``[s/cp, b, ...]`` (and finite ``[s/cp, b]``), all-gathered and put in position order:
    ``[s, b, ...]`` on every rank."""
    cp = cp_size_of(cp_group)
    if cp == 1:
        return rows, finite
    seq_length = finite.shape[0] * cp

    def whole(part: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(part) for _ in range(cp)]
        dist.all_gather(parts, part.contiguous(), group=cp_group)
        out = part.new_empty((seq_length,) + tuple(part.shape[1:]))
        for rank, values in enumerate(parts):
            for start, position, length in rank_chunks(seq_length, cp, rank):
                out[position:position + length] = values[start:start + length]
        return out

    gathered = whole(finite.to(torch.uint8)).bool()
    return {name: whole(values) for name, values in rows.items()}, gathered
