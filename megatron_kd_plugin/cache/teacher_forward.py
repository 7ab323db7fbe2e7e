"""A megatron-core GPT teacher as the cache writer's ``TeacherFn``, on any TP × PP × EP × DP layout, forward only.

``TeacherForward(chunks, vocab_size=V, ...)(tokens [b, s], position_ids [b, s])`` gives this rank's ``teacher_head.TeacherHidden`` (on
the last pipeline stage; None on the others): the final hidden states ``[s, b, H]`` and the lm_head shard
``[V_pad/tp, H]``, taken through GPTModel's ``output_processor`` hook before the output layer runs, so the logits
are formed only block by block by the fused head (``teacher_head.py``). Beyond a plain forward it does what real
teachers need:

- Documents: each row's documents are attended separately, positions restarting at every one
  (``megatron_kd_plugin.documents``): megatron-core's local attention gets the block-diagonal causal mask
  ``[b, 1, s, s]``; Transformer Engine's attention gets the rows as one THD batch of packed sequences
  (``PackedSeqParams``, ``cu_seqlens`` at every document), every pipeline stage alike.

- Pipeline parallelism: the batch runs as b pipeline micro-batches of one sample. A stage receives each
  micro-batch's hidden states ``[s, 1, h]`` from the previous stage (megatron-core's ``P2PCommunicator``),
  runs its layers and sends them on; the last stage collects the logits. Stage i works on micro-batch j while
  stage i+1 works on j−1, so the pipeline fills once per batch (bubble (pp−1)/(b+pp−1)). megatron-core's
  schedules are not used: they allocate on "cuda" and drive backward passes.
- The padded vocabulary: Megatron pads the output layer to a multiple of ``make_vocab_size_divisible_by`` × TP;
  the head sets logits of ids >= ``vocab_size`` (the teacher's true size) to −inf on the TP shard that holds them
  (``teacher_head.mask_padded_vocab``), so they never enter a top-K, a draw or the logsumexp.
- Context parallelism (``cp_group`` of size cp > 1): each CP rank runs its load-balanced slice of every window
  (``teacher_context_parallel.py``: tokens and position ids sliced as megatron-core slices a batch, the causal mask left to
  Transformer Engine's attention, which alone runs CP) and hands its slice's hidden states ``[s/cp, b, H]``.
- Expert parallelism in lock step: a MoE layer exchanges tokens between its EP ranks at every forward (the
  allgather dispatcher even needs equal shapes), while those ranks cache different data and may own a
  different number of batches. With ``lockstep`` every batch is padded to ``micro_batch_size`` samples (the pad
  rows' outputs are dropped), and before each forward all ranks all-reduce (MAX) whether any of them still has
  a batch: a rank that has none (in :meth:`finish`) runs a dummy forward alongside, until none has.

Shapes: tokens int64 ``[b, s]``; hidden states ``[s, b, H]`` (megatron's ``[s, b]`` order).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_kd_plugin.cache.teacher_context_parallel import cp_size_of, slice_tokens
from megatron_kd_plugin.cache.teacher_head import TeacherHidden
from megatron_kd_plugin.documents import (WINDOW_DROPS_MASK, causal_mask, document_attention, document_attention_mask,
                                          packed_seq_params, several_documents)


def head_inputs(*, hidden_states, output_layer, output_weight, scale_logits, **_):
    """GPTModel ``output_processor``: (final hidden states ``[s, b, H]``, lm_head shard ``[V/tp, H]``, the model's
    logit scaling) instead of the logits; sequence-parallel hidden states are gathered (forward only)."""
    if getattr(output_layer, "bias", None) is not None:
        raise ValueError("the teacher's output layer has a bias: the fused head forms X·Wᵀ only")
    if getattr(output_layer, "sequence_parallel", False):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(hidden_states)
    weight = output_weight if output_weight is not None else output_layer.weight
    return hidden_states, weight, scale_logits


def refuse_documents_under_cp(position_ids: torch.Tensor) -> None:
    """ValueError (one line) for rows of several documents under context parallelism."""
    if several_documents(position_ids):
        raise ValueError("context parallelism (cp > 1) with rows of several documents (layout packed or document) "
                         "is not supported: cache them with cp = 1")


class TeacherForward:
    """This rank's part of a teacher forward (see the module docstring); call it like a ``TeacherFn``.

    ``chunks``: the rank's model chunks (one; virtual pipeline stages are not supported), in eval mode.
    ``vocab_size``: the teacher's true vocabulary. ``tp_rank``: this rank's tensor-parallel rank.
    ``pp_group``: the pipeline group (None or size 1: no pipeline). ``lockstep``: pad batches to
    ``micro_batch_size`` samples of ``seq_length`` tokens and let :meth:`finish` even out the number of forwards
    (needed with EP > 1).
    """

    def __init__(self, chunks, *, vocab_size: int, tp_rank: int = 0, pp_group=None, lockstep: bool = False,
                 micro_batch_size: int = 1, seq_length: int | None = None, cp_group=None):
        if lockstep and seq_length is None:
            raise ValueError("lockstep needs the seq_length of the dummy forwards")
        if len(chunks) != 1:
            raise ValueError(f"{len(chunks)} model chunks: virtual pipeline stages are not supported")
        self.model = chunks[0]
        from megatron.core.transformer.module import Float16Module

        self.half_precision = isinstance(self.model, Float16Module)
        self.weight = self.scale_logits = None      # the last stage's lm_head shard and logit scaling (``_stage``)
        self.vocab_size, self.tp_rank = vocab_size, tp_rank
        self.lockstep, self.micro_batch_size, self.seq_length = lockstep, micro_batch_size, seq_length
        self.pipeline = None
        self.cp_group = cp_group if cp_size_of(cp_group) > 1 else None
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self.pipeline = P2PCommunicator(pp_group=pp_group, config=self.model.config)

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.is_pp_last_stage

    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> TeacherHidden | None:
        """The head's inputs of tokens ``[b, s]`` at ``position_ids`` ``[b, s]`` (restarting at every document) on
        the last stage, None on the others."""
        b = tokens.shape[0]
        if self.lockstep:
            self._anyone_busy(True)
            if b < self.micro_batch_size:
                tokens = torch.cat([tokens, tokens.new_zeros(self.micro_batch_size - b, tokens.shape[1])])
                position_ids = torch.cat([position_ids, _stream_positions(self.micro_batch_size - b, tokens.shape[1])])
        return self._forward(tokens, position_ids, b)

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, b: int) -> TeacherHidden | None:
        """The head's inputs of the first ``b`` samples of ``tokens`` (last stage; None on the others)."""
        device = next(self.model.parameters()).device
        tokens, position_ids = tokens.to(device), position_ids.to(device)
        hidden = self._pipeline_forward(tokens, position_ids) if self.pipeline else self._stage(tokens, position_ids)
        if hidden is None:
            return None
        return TeacherHidden(hidden=hidden[:, :b], weight=self.weight, vocab_size=self.vocab_size,
                             tp_rank=self.tp_rank, scale_logits=self.scale_logits)

    def _stage(self, tokens: torch.Tensor, position_ids: torch.Tensor, hidden: torch.Tensor | None = None
               ) -> torch.Tensor:
        """This stage's output for tokens ``[b, s]`` at ``position_ids``: hidden states ``[s, b, h]`` (on the last
        stage the final ones, after the final norm; its lm_head shard and logit scaling kept in ``weight``,
        ``scale_logits``); ``hidden`` is the previous stage's output (None on the first stage)."""
        b, s = tokens.shape
        packed = self.cp_group is None and self.attention == "packed_sequences" and several_documents(position_ids)
        if hidden is not None:
            self.model.set_input_tensor(hidden.reshape(s, b, -1).transpose(0, 1).reshape(b * s, 1, -1)
                                        if packed else hidden)
        inputs, extra = self._inputs(tokens, position_ids, packed)
        if not self.is_last_stage:
            output = self.model(*inputs, **extra)
        else:
            half = {"fp32_output": False} if self.half_precision else {}  # a bf16 head, as the output layer's GEMM
            output, self.weight, self.scale_logits = self.model(*inputs, output_processor=head_inputs, **half, **extra)
        return output.reshape(b, s, -1).transpose(0, 1) if packed else output    # THD [b·s, 1, h] -> [s, b, h]

    @functools.cached_property
    def attention(self) -> str:
        return document_attention(self.model)

    def _inputs(self, tokens: torch.Tensor, position_ids: torch.Tensor, packed: bool) -> tuple[tuple, dict]:
        """((tokens, position ids, attention mask), keyword arguments) of the model call: this CP rank's slice under
        CP (no mask: the attention's own causal mask; one document per row only); rows of one document each as
        before documents existed (the causal mask ``[1, 1, s, s]``); rows of several documents with Transformer
        Engine's attention (``packed``) as one THD sequence of packed documents ``[1, b·s]``, on local attention
        with their block-diagonal causal mask ``[b, 1, s, s]``."""
        if self.cp_group is not None:
            refuse_documents_under_cp(position_ids)
            return (slice_tokens(tokens, self.cp_group), slice_tokens(position_ids, self.cp_group), None), {}
        if packed:
            return ((tokens.reshape(1, -1), position_ids.reshape(1, -1), None),
                    {"packed_seq_params": packed_seq_params(position_ids)})
        if not several_documents(position_ids):
            return (tokens, position_ids, causal_mask(tokens.shape[1], tokens.device)), {}
        if self.attention == "window_drops_mask":
            raise ValueError(WINDOW_DROPS_MASK)
        return (tokens, position_ids, document_attention_mask(position_ids)), {}

    def _pipeline_forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Every sample of ``tokens [b, s]`` through the pipeline as its own micro-batch (see the module docstring)."""
        pipeline, config = self.pipeline, self.model.config
        shape = (tokens.shape[1] // cp_size_of(self.cp_group), 1, config.hidden_size)   # [s/cp, 1, h]
        outputs = []
        for sample, positions in zip(tokens.split(1), position_ids.split(1)):
            hidden = None if pipeline.is_pp_first_stage else pipeline.recv_forward(shape, is_first_stage=False)
            output = self._stage(sample, positions, hidden)
            if self.is_last_stage:
                outputs.append(output)
            else:
                pipeline.send_forward(output.contiguous(), is_last_stage=False)
        return torch.cat(outputs, dim=1) if self.is_last_stage else None

    def _anyone_busy(self, busy: bool) -> bool:
        """All-reduce (MAX over the world) of "this rank has a batch to run"."""
        flag = torch.tensor([int(busy)], dtype=torch.int64, device=next(self.model.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def finish(self) -> None:
        """With ``lockstep``: dummy forwards while any other rank still runs batches (every rank calls this after
        its last batch, before any other collective). Without: nothing."""
        if not self.lockstep:
            return
        dummy = torch.zeros(self.micro_batch_size, self.seq_length, dtype=torch.int64)
        positions = _stream_positions(self.micro_batch_size, self.seq_length)
        while self._anyone_busy(False):
            self._forward(dummy, positions, 0)


def _stream_positions(b: int, s: int) -> torch.Tensor:
    """int64 ``[b, s]``: 0..s-1 in every row (rows of one document each, e.g. the pad rows of a lock-step batch)."""
    return torch.arange(s).expand(b, s).clone()
