"""Triton kernels for the two per-chunk operations; the math is in ``megatron_kd_plugin.kernels.reference``.

Memory traffic per chunk (the [c, Vp] logits dominate everything else):
  ``chunk_row_stats``   one read of the chunk: each program streams a span of one row in BLOCK_V tiles with an
                        online max / rescaled sum-exp (one exp per element), the split partials are merged by a few
                        [c, splits] torch ops; the program of split 0 also gathers the J ids (J scattered reads).
                        With ``exclude`` (sorted), each tile counts which excluded ids fall inside it (E compares
                        per tile) and zeroes only those columns (~E * BLOCK_V / Vp compares per element).
  ``chunk_logit_grad_`` one read + one write of the chunk, in three launches on the stream, no host sync:
                        (1) per token, the exact fp32 gradient at its J ids (dense term at the id + the sum of the
                        sparse coefficients of all equal ids) into a [c, J] buffer, read before anything is
                        overwritten; (2) the dense term over the whole chunk, in place, in the logits' dtype;
                        (3) the [c, J] values stored at their ids (equal ids store equal values, so races are benign).
All math is fp32; results are written in the logits' dtype (bf16 on GPU) so they feed the dX = G W and dW = Gᵀ X
cuBLAS products directly. Compiled without floating-point contraction (``enable_fp_fusion=False``): u = x * scale is
rounded once, the same way in every kernel and in the row max M it is compared with, so exp(u - M) = 1 at the max.
Contracted, exp(fma(x, scale, -M)) kept the product's rounding error (4.3e-6 at x = 200, tau = 1.3) while M and the
gathered values had lost it: the dense term the grad kernel writes at a support id no longer cancelled the one the
loss subtracts there (``chunk_backends.TritonChunks.coefs``), and a saturated fp32 row's dW erred by 3.6e-4 of its
largest entry on the H200 (tests/loss_triton_checks.py's saturated case; the interpreter never contracts).

The kernels are jitted on first use, not at import, each way once: compiled (autotuned over a few BLOCK_V keyed by
Vp) or, under ``TRITON_INTERPRET=1``, interpreted with one small tile config. The interpreter also needs
triton.language itself imported under that variable (tl.max and tl.sum are jitted helpers), so interpreted runs
set it before anything imports triton (tests/test_kernels.py runs them in a fresh process).
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from megatron_kd_plugin.kernels.runtime import interpreting


def _row_stats(logits_ptr, ids_ptr, exclude_ptr, max_ptr, sumexp_ptr, gathered_ptr, Vp, J, E, span, n_splits,
               stride_logits, stride_ids, stride_exclude, scale, HAS_EXCLUDE: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_J: tl.constexpr):
    """Grid (c, n_splits): the online max / sum-exp of u over columns [split * span, (split + 1) * span) of one row
    (the sum without the columns in the row's ascending ``exclude`` ids if HAS_EXCLUDE); split 0 also writes
    gathered[t, :]."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_logits
    start = split * span
    end = tl.minimum(start + span, Vp)
    run_max = float("-inf")
    run_sum = 0.0
    for col0 in range(start, end, BLOCK_V):
        cols = col0 + tl.arange(0, BLOCK_V)
        u = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * scale  # [BLOCK_V]
        new_max = tl.maximum(run_max, tl.max(u, axis=0))
        e = tl.exp(u - new_max)
        if HAS_EXCLUDE:  # the excluded ids inside this tile are exclude[lo:hi] (sorted): ~J * BLOCK_V / Vp of them
            lo = 0
            hi = 0
            for e0 in range(0, E, BLOCK_J):
                in_row = e0 + tl.arange(0, BLOCK_J) < E
                ex = tl.load(exclude_ptr + row * stride_exclude + e0 + tl.arange(0, BLOCK_J), mask=in_row, other=0)
                lo += tl.sum((in_row & (ex < col0)).to(tl.int32), axis=0)
                hi += tl.sum((in_row & (ex < col0 + BLOCK_V)).to(tl.int32), axis=0)
            for i in range(lo, hi):
                e = tl.where(cols == tl.load(exclude_ptr + row * stride_exclude + i), 0.0, e)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(e, axis=0)
        run_max = new_max
    tl.store(max_ptr + row * n_splits + split, run_max)
    tl.store(sumexp_ptr + row * n_splits + split, run_sum)
    if split == 0:
        for k0 in range(0, J, BLOCK_J):
            ks = k0 + tl.arange(0, BLOCK_J)
            in_row = ks < J
            ids = tl.load(ids_ptr + row * stride_ids + ks, mask=in_row, other=-1)  # [BLOCK_J]
            present = ids >= 0
            x = tl.load(row_ptr + ids, mask=present, other=0.0).to(tl.float32)
            tl.store(gathered_ptr + row * J + ks, tl.where(present, x * scale, 0.0), mask=in_row)


def _grad_at_ids(logits_ptr, ids_ptr, sparse_ptr, lse_ptr, dense_ptr, ce_lse_ptr, ce_coef_ptr, out_ptr, J,
                 stride_logits, stride_ids, scale, HAS_CE: tl.constexpr, BLOCK_J: tl.constexpr):
    """Grid (c, cdiv(J, BLOCK_J)): out[t, k] = G[t, ids[t, k]] in fp32 (the full gradient at that column), read
    from the logits before they are overwritten."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    in_row = ks < J
    ids = tl.load(ids_ptr + row * stride_ids + ks, mask=in_row, other=-1)  # [BLOCK_J]
    present = ids >= 0
    x = tl.load(logits_ptr + row * stride_logits + ids, mask=present, other=0.0).to(tl.float32)
    sparse_sum = tl.zeros((BLOCK_J,), tl.float32)  # sum of sparse_coef over all k' with ids[k'] == ids[k]
    for k0 in range(0, J, BLOCK_J):
        others = k0 + tl.arange(0, BLOCK_J)
        other_ids = tl.load(ids_ptr + row * stride_ids + others, mask=others < J, other=-1)
        other_coef = tl.load(sparse_ptr + row * J + others, mask=others < J, other=0.0)
        same = (ids[:, None] == other_ids[None, :]) & (other_ids[None, :] >= 0)  # [BLOCK_J, BLOCK_J]
        sparse_sum += tl.sum(tl.where(same, other_coef[None, :], 0.0), axis=1)
    grad = scale * (tl.load(dense_ptr + row) * tl.exp(x * scale - tl.load(lse_ptr + row)) + sparse_sum)
    if HAS_CE:
        grad += tl.load(ce_coef_ptr + row) * tl.exp(x - tl.load(ce_lse_ptr + row))
    tl.store(out_ptr + row * J + ks, grad, mask=in_row)


def _dense_grad(logits_ptr, lse_ptr, dense_ptr, ce_lse_ptr, ce_coef_ptr, Vp, stride_logits, scale,
                HAS_CE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (c, cdiv(Vp, BLOCK_V)): logits[t, tile] <- scale * dense_coef[t] * exp(u - lse[t]) (+ the CE term)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < Vp
    ptrs = logits_ptr + row * stride_logits + cols
    raw = tl.load(ptrs, mask=in_row, other=0.0)
    x = raw.to(tl.float32)  # [BLOCK_V]
    grad = (scale * tl.load(dense_ptr + row)) * tl.exp(x * scale - tl.load(lse_ptr + row))
    if HAS_CE:
        grad += tl.load(ce_coef_ptr + row) * tl.exp(x - tl.load(ce_lse_ptr + row))
    tl.store(ptrs, grad.to(raw.dtype), mask=in_row)


def _scatter_at_ids(logits_ptr, ids_ptr, values_ptr, J, stride_logits, stride_ids, BLOCK_J: tl.constexpr):
    """Grid (c, cdiv(J, BLOCK_J)): logits[t, ids[t, k]] <- values[t, k] for ids >= 0."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    in_row = ks < J
    ids = tl.load(ids_ptr + row * stride_ids + ks, mask=in_row, other=-1)
    values = tl.load(values_ptr + row * J + ks, mask=in_row, other=0.0)
    tl.store(logits_ptr + row * stride_logits + ids, values.to(logits_ptr.dtype.element_ty), mask=ids >= 0)


_STATS_CONFIGS = [triton.Config({"BLOCK_V": block}, num_warps=warps) for block, warps in ((2048, 8), (4096, 8),
                                                                                          (8192, 16))]
_GRAD_CONFIGS = [triton.Config({"BLOCK_V": block}, num_warps=warps) for block, warps in ((1024, 4), (2048, 8),
                                                                                         (4096, 8))]
_LOOP_BOUNDS = ["Vp", "J", "E", "span", "n_splits"]  # not specialised: fewer compiled variants, same code


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The jitted kernels plus launch constants; autotuned when compiled, one small config when interpreted."""
    def jit(fn):
        return triton.jit(fn, do_not_specialize=[a for a in _LOOP_BOUNDS if a in inspect.signature(fn).parameters])

    if interpret:  # small tiles and spans, so small test shapes cross tile, split and J-block edges
        if isinstance(tl.max, triton.runtime.JITFunction):
            raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported, so triton.language's own "
                               "helpers (tl.max, tl.sum) cannot be interpreted: set it before anything imports "
                               "triton (megatron-core does at import), e.g. in the environment of a fresh process")
        return SimpleNamespace(row_stats=jit(_row_stats), dense_grad=jit(_dense_grad),
                               grad_at_ids=jit(_grad_at_ids), scatter_at_ids=jit(_scatter_at_ids),
                               fixed={"BLOCK_V": 32}, min_span=48, target_programs=1 << 30, block_j=32, options={})
    return SimpleNamespace(
        row_stats=triton.autotune(_STATS_CONFIGS, key=["Vp"])(jit(_row_stats)),
        dense_grad=triton.autotune(_GRAD_CONFIGS, key=["Vp"], restore_value=["logits_ptr"])(jit(_dense_grad)),
        grad_at_ids=jit(_grad_at_ids), scatter_at_ids=jit(_scatter_at_ids),
        fixed={}, min_span=8192, target_programs=4 * _num_sms(), block_j=64, options={"enable_fp_fusion": False})


def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _split_span(c: int, Vp: int, min_span: int, target_programs: int) -> tuple[int, int]:
    """(n_splits, span): split each row into spans of >= min_span columns until c * n_splits ~ target_programs;
    every split is non-empty."""
    n_splits = max(1, min(triton.cdiv(target_programs, max(c, 1)), triton.cdiv(Vp, min_span)))
    span = triton.cdiv(Vp, n_splits)
    return triton.cdiv(Vp, span), span


def chunk_row_stats(logits: torch.Tensor, ids: torch.Tensor, scale: float,
                    exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton ``chunk_row_stats``; inputs already checked by the dispatcher (logits last dim contiguous, ``exclude``
    sorted ascending per row)."""
    k = _kernels(interpreting())
    c, Vp = logits.shape
    J = ids.shape[1]
    has_exclude = exclude is not None
    exclude = exclude if has_exclude else ids  # an unread placeholder when not has_exclude
    n_splits, span = _split_span(c, Vp, k.min_span, k.target_programs)
    part_max = logits.new_empty((c, n_splits), dtype=torch.float32)  # [c, splits]
    part_sum = torch.empty_like(part_max)  # [c, splits]
    gathered = logits.new_empty((c, J), dtype=torch.float32)  # [c, J]
    if c > 0:
        k.row_stats[(c, n_splits)](logits, ids, exclude, part_max, part_sum, gathered, Vp, J, exclude.shape[1], span,
                                   n_splits, logits.stride(0), ids.stride(0), exclude.stride(0), float(scale),
                                   HAS_EXCLUDE=has_exclude, BLOCK_J=k.block_j, **k.fixed, **k.options)
    if n_splits == 1:
        return part_max[:, 0], part_sum[:, 0], gathered
    row_max = part_max.amax(dim=1)  # [c]
    return row_max, (part_sum * (part_max - row_max[:, None]).exp()).sum(dim=1), gathered


def chunk_logit_grad_(logits: torch.Tensor, lse: torch.Tensor, dense_coef: torch.Tensor, ids: torch.Tensor,
                      sparse_coef: torch.Tensor, scale: float, *, ce_lse: torch.Tensor | None = None,
                      ce_coef: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``chunk_logit_grad_``; inputs already checked by the dispatcher (fp32 [c] / [c, J] contiguous)."""
    k = _kernels(interpreting())
    c, Vp = logits.shape
    J = ids.shape[1]
    if c == 0:
        return logits
    has_ce = ce_coef is not None
    ce_lse, ce_coef = (ce_lse, ce_coef) if has_ce else (lse, dense_coef)  # unread placeholders when not has_ce
    at_ids = logits.new_empty((c, J), dtype=torch.float32)  # [c, J]
    j_grid = (c, triton.cdiv(J, k.block_j))
    if J > 0:
        k.grad_at_ids[j_grid](logits, ids, sparse_coef, lse, dense_coef, ce_lse, ce_coef, at_ids, J,
                              logits.stride(0), ids.stride(0), float(scale), HAS_CE=has_ce, BLOCK_J=k.block_j,
                              **k.options)
    k.dense_grad[lambda meta: (c, triton.cdiv(Vp, meta["BLOCK_V"]))](
        logits, lse, dense_coef, ce_lse, ce_coef, Vp, logits.stride(0), float(scale), HAS_CE=has_ce, **k.fixed,
        **k.options)
    if J > 0:
        k.scatter_at_ids[j_grid](logits, ids, at_ids, J, logits.stride(0), ids.stride(0), BLOCK_J=k.block_j)
    return logits
