"""The attention of a row of documents, from its position ids alone.

A document is a maximal run of positions whose ids count up by 1 from a 0 (positions restart at 0 at every
document's first token; a stream row is one document, 0..S-1). Position i attends to j iff j <= i and both lie in the
same document: a block-diagonal causal mask. megatron-core's local attention takes it as an explicit bool mask
(:func:`document_attention_mask`, True = masked); Transformer Engine's attention takes the documents as packed
sequences (:func:`packed_seq_params`, THD with cumulative sequence lengths).
"""

from __future__ import annotations

import torch


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[b, S]``: the index of each position's document within its row (0, 0, ..., 1, 1, ...)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(dim=1) - 1


def several_documents(position_ids: torch.Tensor) -> bool:
    """Whether any row of position_ids ``[b, S]`` holds more than one document (else every row is 0..S-1's run)."""
    return bool((position_ids[:, 1:] != position_ids[:, :-1] + 1).any())


def causal_mask(s: int, device=None) -> torch.Tensor:
    """bool ``[1, 1, s, s]``: True above the diagonal (rows of one document each)."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1).view(1, 1, s, s)


def document_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[b, 1, S, S]`` of position_ids ``[b, S]``: True where query i must not attend key j (j > i, or j in
    another document)."""
    documents = document_ids(position_ids)
    s = position_ids.shape[1]
    return causal_mask(s, position_ids.device) | (documents[:, :, None] != documents[:, None, :]).unsqueeze(1)


def packed_seq_params(position_ids: torch.Tensor):
    """megatron-core ``PackedSeqParams`` (``qkv_format="thd"``) of position_ids ``[b, S]``: every document of every
    row one sequence, in row-major order; ``cu_seqlens`` int32 ``[documents + 1]``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    documents = document_ids(position_ids) + torch.arange(position_ids.shape[0], device=position_ids.device)[:, None] * \
        position_ids.shape[1]                         # unique ids across rows, ascending in row-major order
    lengths = torch.unique_consecutive(documents.flatten(), return_counts=True)[1]
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
