"""The teacher's fused head: its final hidden states and lm_head shard go in, a store kind's rows come out, one block
of tokens at a time, so no ``[T, V/tp]`` logits tensor ever exists.

Math (one micro-batch; X ``[s, b, H]`` the final hidden states after the final norm, W_r ``[V_p, H]`` TP rank r's
lm_head shard, σ the model's logit scaling, identity unless MuP)::

    z_blk = mask(σ(X_blk W_rᵀ))        [p, n, V_p]   a block of p positions × n samples
    rows  = kind.teacher_rows(z_blk)   [p, n, ...]    the kind's own math (``kinds/``), which is per token

``mask`` sets the logits of padded vocab ids (>= the teacher's true vocab) to −inf (``mask_padded_vocab``). Every
kind's math is a function of each token's logits alone (its collectives run over the TP group on the same tokens), so
the rows of a block are the rows of the same tokens of the whole micro-batch: one loop (:func:`head_rows`) feeds
every kind, and the kinds keep one copy of their math. The blocks' logits equal the whole GEMM's up to the BLAS's
reduction order (a few fp32 ulps on CPU, where a small-M GEMM takes another kernel).

Memory: a block holds ``p·n·V_p`` logits in the model's dtype plus the kind's work buffers
(``StoreKind.work_bytes_per_logit``), bounded by ``chunk_bytes`` (:func:`block_shape`): flat in s.

Shapes: hidden ``[s, b, H]``, weight ``[V_p, H]``; rows ``[s, b, ...]``, finite ``[s, b]``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

DEFAULT_CHUNK_BYTES = 2**30
"""The head's default block budget in bytes (logits and the kind's work buffers of one block)."""


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Sets logits of ids >= ``vocab_size`` to −inf in place; ``logits [..., V_p]`` is TP rank ``tp_rank``'s shard
    (global ids ``[tp_rank·V_p, (tp_rank+1)·V_p)``). Returns ``logits``."""
    vocab_local = logits.shape[-1]
    first_padded = vocab_size - tp_rank * vocab_local       # local index of the first padded id
    if first_padded < vocab_local:
        logits[..., max(first_padded, 0):] = float("-inf")
    return logits


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherHidden:
    """One micro-batch of a teacher's last pipeline stage, before its lm_head (module docstring)."""

    hidden: torch.Tensor
    """``[s, b, H]`` final hidden states (after the final norm), in the model's dtype."""
    weight: torch.Tensor
    """``[V_p, H]`` this TP rank's lm_head shard (vocab ids ``[tp_rank·V_p, (tp_rank+1)·V_p)``)."""
    vocab_size: int
    """The teacher's true vocabulary (ids at or above it are padding)."""
    tp_rank: int = 0
    """This rank's tensor-parallel rank."""
    scale_logits: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits
    """The model's logit scaling (GPTModel's ``_scale_logits``: MuP; identity otherwise)."""

    @property
    def tokens(self) -> tuple[int, int]:
        """(s, b)."""
        return tuple(self.hidden.shape[:2])

    @property
    def vocab_local(self) -> int:
        return self.weight.shape[0]

    @property
    def logit_bytes(self) -> int:
        return torch.promote_types(self.hidden.dtype, self.weight.dtype).itemsize

    def logits(self, positions: slice, samples: slice) -> torch.Tensor:
        """``[p, n, V_p]`` the masked logits of a block of tokens."""
        block = torch.matmul(self.hidden[positions, samples], self.weight.t())
        return mask_padded_vocab(self.scale_logits(block), self.vocab_size, self.tp_rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherLogits:
    """A micro-batch of logits a teacher already formed (``[s, b, V_p]``, padding masked): synthetic teachers."""

    full: torch.Tensor

    @property
    def tokens(self) -> tuple[int, int]:
        return tuple(self.full.shape[:2])

    @property
    def vocab_local(self) -> int:
        return self.full.shape[-1]

    @property
    def logit_bytes(self) -> int:
        return self.full.dtype.itemsize

    def logits(self, positions: slice, samples: slice) -> torch.Tensor:
        return self.full[positions, samples]


TeacherOutput = TeacherHidden | TeacherLogits


def teacher_output(output: TeacherOutput | torch.Tensor) -> TeacherOutput:
    """``output`` as a :data:`TeacherOutput` (a plain ``[s, b, V_p]`` tensor becomes :class:`TeacherLogits`)."""
    return TeacherLogits(full=output) if isinstance(output, torch.Tensor) else output


@dataclasses.dataclass(frozen=True)
class TokenBlock:
    """Where a block of tokens lies: the global index of its first sample and the position of its first token (a
    kind's draws take their uniforms from them, ``draws.draw_uniforms``)."""

    first_sample: int
    first_position: int


def block_shape(tokens: tuple[int, int], row_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """(positions p, samples n) per block of a micro-batch of ``tokens`` (s, b) so that ``p·n`` token rows of
    ``row_bytes`` each fit ``chunk_bytes``: every sample of as many positions as fit, else one position of as many
    samples as fit. ValueError, in one line, when one token row does not fit."""
    if chunk_bytes < row_bytes:
        raise ValueError(f"chunk_bytes={chunk_bytes} is below one token row of the teacher's head ({row_bytes} "
                         "bytes: V/tp logits and the store kind's work buffers); raise it")
    s, b = tokens
    rows = chunk_bytes // row_bytes
    return (min(s, rows // b), b) if rows >= b else (1, rows)


def row_bytes(vocab_local: int, logit_bytes: int, work_bytes_per_logit: int) -> int:
    """Bytes of one token row of the head: its ``vocab_local`` logits (``logit_bytes`` each) and the kind's work."""
    return vocab_local * (logit_bytes + work_bytes_per_logit)


RowsFn = Callable[[torch.Tensor, TokenBlock], tuple[dict[str, torch.Tensor], torch.Tensor]]
"""(logits ``[p, n, V_p]``, block) -> ({name: rows ``[p, n, ...]``}, finite ``[p, n]``): a kind's ``teacher_rows``."""


def head_rows(output: TeacherOutput, rows_fn: RowsFn, *, first_sample: int, work_bytes_per_logit: int,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, spans: tuple[tuple[int, int, int], ...] | None = None
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({name: ``[s, b, ...]``}, finite ``[s, b]``): ``rows_fn`` on every block of the micro-batch ``output`` whose
    first sample is ``first_sample`` (module docstring); the blocks' rows written into the whole's.
    ``work_bytes_per_logit``: the kind's work buffers per logit, beside the logits themselves. ``spans``: ((row,
    position, length), ...) when ``output``'s s rows are runs of a longer window (a context-parallel slice,
    ``context_parallel.rank_chunks``): rows [row, row + length) hold positions [position, position + length), and no
    block straddles two runs; default: row i is position i."""
    s, b = output.tokens
    p, n = block_shape((s, b), row_bytes(output.vocab_local, output.logit_bytes, work_bytes_per_logit), chunk_bytes)
    rows: dict[str, torch.Tensor] = {}
    finite = None
    blocks = [(row + offset, position + offset, min(p, length - offset))
              for row, position, length in (spans or ((0, 0, s),)) for offset in range(0, length, p)]
    for row, position, count in blocks:
        for sample in range(0, b, n):
            where = (slice(row, row + count), slice(sample, sample + n))
            part, part_finite = rows_fn(output.logits(*where), TokenBlock(first_sample + sample, position))
            if finite is None:
                rows = {name: values.new_empty((s, b) + values.shape[2:]) for name, values in part.items()}
                finite = part_finite.new_empty((s, b))
            for name, values in part.items():
                rows[name][where] = values
            finite[where] = part_finite
    return rows, finite
