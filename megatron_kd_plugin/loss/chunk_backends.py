"""The per-chunk vocab work of the chunk loop, behind one interface with two backends: PyTorch and Triton.

For one chunk of c tokens with raw logits r [c, V/tp] (``token_math`` for the names), the loop calls, in order:

    chunk = backend.load(r, rows)
    M = MAX-all-reduce(chunk.local_max())                                 # [c] max_j z_j, z = r / tau
    partials = SUM-all-reduce(chunk.partial_sums(M))     # [c, width]: E_tail, g, r_y, S1, S1_tail as the plan
                                                         # forms them (``token_math.ReducedColumns``)
    coefs = backend.coefs(rows, token_terms(...), partials)               # ChunkCoefs, linear in d loss
    grad = chunk.logits_grad_(M, coefs)                                   # [c, V/tp] d loss / d r, in r's buffer

Backward in ``recompute`` mode repeats ``load`` and ``logits_grad_`` with the saved M and scaled coefficients.

``TorchChunks`` (the PyTorch pieces below): z = r / tau in place in the accumulation dtype, E = exp(z - M) off the
support in place (and E1 = exp(r - tau M) in a second buffer for CE at tau != 1; S1_tail = sum of E^tau for the ghost
tail at tau != 1), gradient dr = dense E + ce_dense E1 + scatter(support) + scatter(label).
``TritonChunks`` (``megatron_kd_plugin.kernels``, math in ``kernels/reference.py``): r stays in its dtype (bf16 on
GPU). ``chunk_row_stats(r, [support | label], 1/tau, exclude=support)`` gives the local max, the off-support
sum-exp and the gathered z, rescaled to the global M before the SUM all-reduce (a second
``chunk_row_stats(r, -, 1)`` gives S1 for CE at tau != 1, and ``chunk_row_stats(r, -, 1, exclude=support)`` S1_tail
for the ghost tail at tau != 1); ``chunk_logit_grad_`` writes
dr = dense exp(z - M) + ce_dense exp(r - tau M) + scatter(support') + scatter(label) over the whole row, where
support' = support - dense exp(g - M) cancels the dense term the kernel also writes at the support ids.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .loss_plan import KDBatch, LossPlan
from .token_math import TokenPartials, TokenTerms


# The PyTorch pieces, each one kernel's worth of work over a [c, V/tp] buffer. Index inputs are this rank's:
# ``local_ids`` [c, K] int64 in [0, V/tp) and ``local_valid`` [c, K] bool (the slot's id lies in this shard and is a
# bucket); slots that are not local carry a clamped, unused index.

def gather_local(z: torch.Tensor, local_ids: torch.Tensor, local_valid: torch.Tensor) -> torch.Tensor:
    """z at the local ids [c, K] (0 where not local), so a SUM all-reduce assembles the global values."""
    return torch.where(local_valid, z.gather(1, local_ids), z.new_zeros(()))


def exp_off_support_(z: torch.Tensor, shift: torch.Tensor, local_ids: torch.Tensor,
                     local_valid: torch.Tensor) -> torch.Tensor:
    """In place: z [c, V/tp] -> E = exp(z - shift[:, None]) with 0 at the support ids. Returns E."""
    z.sub_(shift[:, None]).exp_()
    keep = (~local_valid).to(z.dtype)           # multiply by 0 at support ids; repeats/non-local slots multiply by 1
    return z.scatter_reduce_(1, local_ids, keep, reduce="prod")


def logits_grad_(exp_off: torch.Tensor, dense_coef: torch.Tensor, local_ids: torch.Tensor,
                 local_support_grad: torch.Tensor, local_label: torch.Tensor | None,
                 local_label_grad: torch.Tensor | None, exp_full: torch.Tensor | None = None,
                 ce_dense_coef: torch.Tensor | None = None) -> torch.Tensor:
    """In place: E (off-support exp) [c, V/tp] -> d loss / d r [c, V/tp]. Returns it.

    dr = dense_coef[:, None] * E + ce_dense_coef[:, None] * E1 + scatter(support_grad) + scatter(label_grad);
    the scattered values must already be 0 where not local.
    """
    grad = exp_off.mul_(dense_coef[:, None])
    if exp_full is not None:
        grad.add_(exp_full.mul_(ce_dense_coef[:, None]))
    grad.scatter_add_(1, local_ids, local_support_grad)
    if local_label is not None:
        grad.scatter_add_(1, local_label[:, None], local_label_grad[:, None])
    return grad


class ChunkCoefs(NamedTuple):
    """d loss / d r of a chunk as per-token coefficients (linear in the loss: backward scales them)."""

    dense: torch.Tensor             # [c] coefficient of exp(z - M) (off the support for torch, everywhere for triton)
    support: torch.Tensor           # [c, K] added at the support ids
    label: torch.Tensor | None      # [c] added at the label id (None without labels)
    ce_dense: torch.Tensor | None   # [c] coefficient of exp(r - tau M) (CE at tau != 1)

    def rows(self, rows: slice) -> ChunkCoefs:
        """The coefficients of tokens ``rows``."""
        return ChunkCoefs(*(None if t is None else t[rows] for t in self))

    def scaled(self, scale: torch.Tensor) -> ChunkCoefs:
        """Every coefficient times ``scale`` (the incoming gradient: a scalar, or [c] one per token)."""
        if scale.dim():
            return ChunkCoefs(*(None if t is None else t * scale.view(-1, *([1] * (t.dim() - 1))) for t in self))
        return ChunkCoefs(*(None if t is None else t * scale for t in self))

    def plus(self, other: ChunkCoefs) -> ChunkCoefs:
        """The coefficients of the sum of two losses' gradients (a term absent from both stays None)."""
        return ChunkCoefs(*(a if b is None else b if a is None else a + b for a, b in zip(self, other, strict=True)))


class _TorchChunk:
    """One chunk on the PyTorch pieces; r is a writable buffer in the accumulation dtype."""

    def __init__(self, plan: LossPlan, batch: KDBatch, r: torch.Tensor, rows: slice):
        self.plan, self.batch, self.rows = plan, batch, rows
        self.z = r.mul_(1.0 / plan.options.temperature) if plan.options.temperature != 1.0 else r   # [c, V/tp]
        self.ids = batch.local_ids[rows].long()                              # [c, K] torch's index dtype
        self.exp = None

    def local_max(self) -> torch.Tensor:
        return self.z.amax(-1)                                               # [c]

    def _exp_buffers(self, row_max: torch.Tensor):
        """(E off the support, in place of z; E1 = exp(tau (z - M)) over the whole vocab for CE at tau != 1)."""
        plan, batch, rows = self.plan, self.batch, self.rows
        with_full = plan.ce_needs_unit_softmax
        full = ((self.z - row_max[:, None]) * plan.options.temperature).exp_() if with_full else None
        return exp_off_support_(self.z, row_max, self.ids, batch.local_valid[rows]), full

    def partial_sums(self, row_max: torch.Tensor) -> torch.Tensor:
        plan, batch, rows = self.plan, self.batch, self.rows
        columns = dict(support_logits=gather_local(self.z, self.ids, batch.local_valid[rows]))   # [c, K] g
        if plan.with_labels:
            columns["label_logit"] = gather_local(self.z, batch.local_label[rows, None],
                                                  batch.label_local[rows, None]) * plan.options.temperature
        self.exp = self._exp_buffers(row_max)
        exp_off, exp_full = self.exp
        if exp_full is not None:
            columns["ce_sum_exp"] = exp_full.sum(-1)
        if plan.tail_needs_student_shape:                                    # S1_tail = sum off S of E^tau
            columns["unit_tail_sum"] = exp_off.pow(plan.options.temperature).sum(-1)
        columns["tail_sum"] = exp_off.sum(-1)
        return plan.reduced_columns(self.ids.shape[1]).pack(**columns)      # [c, width]

    def logits_grad_(self, row_max: torch.Tensor, coefs: ChunkCoefs) -> torch.Tensor:
        plan, batch, rows = self.plan, self.batch, self.rows
        exp_off, exp_full = self.exp if self.exp is not None else self._exp_buffers(row_max)
        zero = exp_off.new_zeros(())
        local_label = label_local = None
        if plan.with_labels:
            local_label = batch.local_label[rows]
            label_local = torch.where(batch.label_local[rows], coefs.label, zero)
        support_local = torch.where(batch.local_valid[rows], coefs.support, zero)
        return logits_grad_(exp_off, coefs.dense, self.ids, support_local, local_label, label_local,
                            exp_full, coefs.ce_dense)


class TorchChunks:
    """The PyTorch backend (any device, any float dtype; the numerics of the reference path)."""

    def __init__(self, plan: LossPlan, batch: KDBatch):
        self.plan, self.batch = plan, batch

    def load(self, r: torch.Tensor, rows: slice) -> _TorchChunk:
        return _TorchChunk(self.plan, self.batch, r, rows)

    def coefs(self, rows: slice, terms: TokenTerms, partials: TokenPartials) -> ChunkCoefs:
        label = terms.label_grad if self.plan.with_labels else None
        return ChunkCoefs(terms.dense_coef, terms.support_grad, label, terms.ce_dense_coef)


class _TritonChunk:
    """One chunk on the Triton kernels; r [c, V/tp] in its own dtype, overwritten by the gradient."""

    def __init__(self, backend: TritonChunks, r: torch.Tensor, rows: slice):
        self.backend, self.r, self.rows = backend, r, rows
        self.support_ids, self.ids = backend.chunk_ids(rows)                 # [c, K], [c, K (+1)]
        self.stats = self.ce_stats = self.tail_stats = None

    def local_max(self) -> torch.Tensor:
        from megatron_kd_plugin.kernels import chunk_row_stats

        backend = self.backend
        tau = backend.plan.options.temperature
        self.stats = chunk_row_stats(self.r, self.ids, 1.0 / tau, exclude=self.support_ids, kernels="triton")
        if backend.plan.ce_needs_unit_softmax:
            self.ce_stats = chunk_row_stats(self.r, self.ids[:, :0], 1.0, kernels="triton")
        if backend.plan.tail_needs_student_shape:
            self.tail_stats = chunk_row_stats(self.r, self.ids[:, :0], 1.0, exclude=self.support_ids,
                                              kernels="triton")
        return self.stats[0].clone()                                         # [c] local max, kept for the rescale

    def partial_sums(self, row_max: torch.Tensor) -> torch.Tensor:
        plan = self.backend.plan
        k = self.support_ids.shape[1]
        local_max, sum_exp, gathered = (t.to(plan.dtype) for t in self.stats)   # [c], [c], [c, K (+1)]
        columns = dict(tail_sum=sum_exp * (local_max - row_max).exp(), support_logits=gathered[:, :k])
        if plan.with_labels:
            columns["label_logit"] = gathered[:, k] * plan.options.temperature
        for name, stats in (("ce_sum_exp", self.ce_stats), ("unit_tail_sum", self.tail_stats)):   # S1, S1_tail
            if stats is not None:
                local_max, local_sum = stats[0].to(plan.dtype), stats[1].to(plan.dtype)
                columns[name] = local_sum * (local_max - plan.options.temperature * row_max).exp()
        return plan.reduced_columns(k).pack(**columns)                       # [c, width]

    def logits_grad_(self, row_max: torch.Tensor, coefs: ChunkCoefs) -> torch.Tensor:
        from megatron_kd_plugin.kernels import chunk_logit_grad_

        tau = self.backend.plan.options.temperature
        sparse = coefs.support if coefs.label is None else torch.cat([coefs.support, coefs.label[:, None]], -1)
        with_ce = coefs.ce_dense is not None
        return chunk_logit_grad_(self.r, row_max, tau * coefs.dense, self.ids, tau * sparse,
                                 1.0 / tau, ce_lse=tau * row_max if with_ce else None,
                                 ce_coef=coefs.ce_dense if with_ce else None, kernels="triton")


class TritonChunks:
    """The Triton backend (CUDA, or CPU under ``TRITON_INTERPRET=1``): local ids with -1 where not on this shard."""

    def __init__(self, plan: LossPlan, batch: KDBatch):
        self.plan, self.batch = plan, batch

    def chunk_ids(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(support ids [c, K], support + label ids [c, K (+1)]): local columns, -1 where not on this shard."""
        batch = self.batch
        support = torch.where(batch.local_valid[rows], batch.local_ids[rows], -1)           # [c, K]
        if not self.plan.with_labels:
            return support, support
        label = torch.where(batch.label_local[rows], batch.local_label[rows], -1).to(support.dtype)
        return support, torch.cat([support, label[:, None]], -1)                          # [c, K + 1]

    def load(self, r: torch.Tensor, rows: slice) -> _TritonChunk:
        return _TritonChunk(self, r, rows)

    def coefs(self, rows: slice, terms: TokenTerms, partials: TokenPartials) -> ChunkCoefs:
        """The kernel writes the dense term at the support ids too: subtract it from their coefficients there."""
        valid = self.batch.local_valid[rows]
        support_exp = torch.where(valid, (partials.support_logits - partials.row_max[:, None]).exp(),
                                  partials.row_max.new_zeros(()))                      # [c, K] exp(g - M)
        support = terms.support_grad - terms.dense_coef[:, None] * support_exp
        label = terms.label_grad if self.plan.with_labels else None
        return ChunkCoefs(terms.dense_coef, support, label, terms.ce_dense_coef)


def chunk_backend(plan: LossPlan, batch: KDBatch) -> TorchChunks | TritonChunks:
    """The backend ``plan.triton`` selects."""
    return TritonChunks(plan, batch) if plan.triton else TorchChunks(plan, batch)
