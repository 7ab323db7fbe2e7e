"""The attention of a row of documents, from its position ids alone: the one place that turns position ids into the
mask megatron-core's local attention takes, or the packed sequences Transformer Engine's attention takes.

Shapes: b rows of S positions; position_ids int [b, S]. A document is a maximal run of positions whose ids count
up by 1 (positions restart at 0 at every document's first token; a stream row is one document, 0..S-1; a row cut
from the middle of a document starts with a run that does not start at 0, and is its own document)::

    start[r, t] = (t == 0) or position_ids[r, t] != position_ids[r, t-1] + 1       # bool [b, S]
    d[r, t]     = Σ_{u <= t} start[r, u] - 1                                        # int64 [b, S], document_ids

Position i of row r attends to j iff j <= i and d[r, i] == d[r, j] (block-diagonal causal):

    mask[r, 0, i, j] = (j > i) or (d[r, i] != d[r, j])          # bool [b, 1, S, S], True = masked
                                                                # (document_attention_mask; local attention)

Packed sequences (``packed_seq_params``; TE's THD attention): the b rows are folded into one sequence of T = b·S
tokens, row after row (tokens and position ids reshaped to [1, T]); its documents are those of every row in
row-major order, of lengths l_1 .. l_n (a document never crosses a row: row r's positions are r·S .. r·S + S - 1):

    cu_seqlens = [0, l_1, l_1 + l_2, ..., T]                    # int32 [n + 1], cu_seqlens_q = cu_seqlens_kv
    max_seqlen = max_k l_k                                      # python int, max_seqlen_q = max_seqlen_kv

A batch whose rows are one document each (``several_documents`` False) needs neither: plain causal attention is
the same attention (megatron-core builds it, or takes ``causal_mask``).

Rotary embeddings: megatron-core's ``RotaryEmbedding`` rotates by the position in the row (it takes the sequence
length, not position_ids), so on the masked path a document at offset o is rotated by o + t where its own positions
are t. Attention scores under RoPE depend only on i − j, which a document's own positions share, so the masked
attention equals each document's alone (up to float rounding of the rotations); TE's THD RoPE restarts at every
``cu_seqlens`` boundary. Learned absolute position embeddings read position_ids themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[b, S]``: True at each document's first position (``start`` of the module docstring)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[b, S]``: the index of each position's document within its row (0, 0, ..., 1, 1, ...)."""
    return document_starts(position_ids).long().cumsum(dim=1) - 1


def several_documents(position_ids: torch.Tensor) -> bool:
    """Whether any row of position_ids ``[b, S]`` holds more than one document (a host read of ``position_ids``:
    give it the batch before it moves to the GPU)."""
    return bool(document_starts(position_ids)[:, 1:].any())


def causal_mask(seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool ``[1, 1, S, S]``: True where j > i (plain causal attention; broadcast over the batch)."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1).view(1, 1, seq_length,
                                                                                            seq_length)


def document_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[b, 1, S, S]`` of position_ids ``[b, S]``: True where query i must not attend key j (j > i, or j in
    another document)."""
    documents = document_ids(position_ids)
    return causal_mask(position_ids.shape[1], position_ids.device) | (
        documents[:, None, :, None] != documents[:, None, None, :])


def packed_seq_params(position_ids: torch.Tensor, device: torch.device | str | None = None) -> PackedSeqParams:
    """megatron-core ``PackedSeqParams`` (``qkv_format="thd"``) of position_ids ``[b, S]``: every document of every
    row one sequence, in row-major order; ``cu_seqlens`` int32 ``[documents + 1]`` on ``device`` (None: position_ids'
    device; give host position ids and the model's device, and no device-to-host read is needed for max_seqlen)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    starts = document_starts(position_ids).flatten()                           # [T]: rows end where the next starts
    bounds = torch.nonzero(torch.cat([starts, starts.new_ones(1)])).flatten()  # [n + 1], T at the end
    lengths = bounds.diff()
    cu_seqlens = bounds.to(device=device, dtype=torch.int32, non_blocking=True)
    longest = int(lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


ATTENTIONS = ("packed_sequences", "mask", "window_drops_mask")
"""How a model's attention keeps a row's documents apart (``document_attention``)."""

WINDOW_DROPS_MASK = ("rows of several documents (a packed or document store) on a model with a sliding-window "
                     "layer under megatron-core's local attention on a GPU: its window layers replace the documents' "
                     "mask by the window's, so documents would see one another; use Transformer Engine's attention "
                     "(packed sequences) or a stream store")
"""The refusal of such rows where ``document_attention`` is ``window_drops_mask``."""


def document_attention(model: torch.nn.Module) -> str:
    """How ``model``'s attention keeps the documents of a row apart (one of :data:`ATTENTIONS`):

    - ``packed_sequences``: Transformer Engine's core attention, which takes ``packed_seq_params`` (THD);
    - ``mask``: megatron-core's local attention, which takes the block-diagonal mask;
    - ``window_drops_mask``: local attention with a sliding-window layer whose softmax replaces the mask it is
      given by its window's (megatron-core's ``FusedScaleMaskSoftmax.forward_torch_softmax``; ``cpu_compat`` makes
      it mask both on a machine without CUDA): rows of several documents are refused (:data:`WINDOW_DROPS_MASK`).
    """
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    from megatron_kd_plugin.cpu_compat import window_keeps_given_mask

    modules = list(model.modules())
    if any(type(module).__name__.startswith("TEDotProductAttention") for module in modules):
        return "packed_sequences"
    windowed = any(isinstance(module, FusedScaleMaskSoftmax) and module.window_size is not None for module in modules)
    return "window_drops_mask" if windowed and not window_keeps_given_mask() else "mask"
