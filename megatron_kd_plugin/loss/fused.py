"""Fused chunked top-K KD: X [T, H] and this rank's lm_head shard W [V/tp, H] in, a scalar loss out.

Never materialises [T, V/tp] logits: per chunk of c tokens r_c = X_c W^T lives in one [c, V/tp] buffer (fp32 on
the PyTorch chunk backend; the inputs' dtype, e.g. bf16, with the Triton kernels) that becomes the chunk's logits
gradient G_c in place, then dX_c = G_c W and dW += G_c^T X_c. ``recompute`` keeps only
per-token coefficients (T*K) and recomputes r_c in backward (4 products per chunk); ``grad_in_forward`` forms
dX and dW during forward and only scales them in backward (3 products). Peak extra memory
~ c * V/tp * 4 B (x2 for CE at tau != 1; Triton: one chunk in the inputs' dtype) + dX (T*H) + dW (V/tp*H, fp32),
flat in T apart from dX. The per-chunk vocab work is ``chunk_backends``' (PyTorch or Triton, ``options.kernels``).
"""

from __future__ import annotations

import torch

from .plan import KDBatch, LossPlan, finish_grad, loss_totals
from .vocab_loop import backward_pass, forward_pass


def _logits_source(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
    def logits_chunk(rows: slice) -> torch.Tensor:
        return hidden[rows].to(dtype) @ weight.t()                           # [c, V/tp]
    return logits_chunk


def _mm_into_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b. Half a, b into an fp32 out: cuBLAS with fp32 output (``out_dtype``) on CUDA, else a product
    in the inputs' dtype added in fp32 (the CPU interpreter runs of the Triton path)."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


def _grad_sink(hidden: torch.Tensor, weight: torch.Tensor, d_hidden, d_weight, dtype: torch.dtype):
    def on_grad(rows: slice, grad: torch.Tensor) -> None:                    # grad [c, V/tp]
        if d_hidden is not None:
            _mm_into_(d_hidden[rows], grad, weight, accumulate=False)        # [c, H]
        if d_weight is not None:
            _mm_into_(d_weight, grad.t(), hidden[rows].to(dtype), accumulate=True)   # [V/tp, H]
    return on_grad


def _gemm_dtype(plan: LossPlan, hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The chunk GEMMs' dtype: the inputs' (bf16 on GPU) with the Triton kernels, else the accumulation dtype."""
    return torch.promote_types(hidden.dtype, weight.dtype) if plan.triton else plan.dtype


def _grad_buffers(plan: LossPlan, hidden: torch.Tensor, work_weight: torch.Tensor, need_dx: bool, need_dw: bool):
    """Zeroed dX [T, H] and dW [V/tp, H] (None where not needed). dW sums over chunks: the accumulation dtype. dX
    rows are each written once by a full-shard GEMM (fp32 accumulation inside cuBLAS), so the Triton path writes
    them in the GEMM dtype."""
    d_hidden_dtype = work_weight.dtype if plan.triton else plan.dtype
    d_hidden = hidden.new_zeros(hidden.shape, dtype=d_hidden_dtype) if need_dx else None
    d_weight = torch.zeros_like(work_weight, dtype=plan.dtype) if need_dw else None
    return d_hidden, d_weight


class _FusedTopKKL(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (loss_sum, kd_sum, ce_sum, student_mass_sum)."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch: KDBatch):
        dtype = _gemm_dtype(plan, hidden, weight)
        work_weight = weight.to(dtype)                                       # a copy only for half inputs
        logits_chunk = _logits_source(hidden, work_weight, dtype)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.plan, ctx.batch, ctx.saved_coefs = plan, batch, None
        ctx.input_dtypes = (hidden.dtype, weight.dtype)
        if plan.options.mode == "grad_in_forward" and (need_dx or need_dw):
            d_hidden, d_weight = _grad_buffers(plan, hidden, work_weight, need_dx, need_dw)
            totals, _ = forward_pass(plan, batch, logits_chunk,
                                     _grad_sink(hidden, work_weight, d_hidden, d_weight, dtype), keep_coefs=False)
            ctx.grads = (d_hidden, d_weight)
        else:
            totals, ctx.saved_coefs = forward_pass(plan, batch, logits_chunk, None, keep_coefs=need_dx or need_dw)
            ctx.save_for_backward(hidden, weight)
            ctx.grads = None
        return loss_totals(ctx, plan, totals)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        hidden_dtype, weight_dtype = ctx.input_dtypes
        if ctx.grads is not None:                                            # grad_in_forward: scale only
            if ctx.grads == ():
                raise RuntimeError("the fused KD loss (grad_in_forward) supports one backward per forward")
            d_hidden, d_weight = ctx.grads
            ctx.grads = ()
        else:
            hidden, weight = ctx.saved_tensors
            plan = ctx.plan
            dtype = _gemm_dtype(plan, hidden, weight)
            work_weight = weight.to(dtype)
            d_hidden, d_weight = _grad_buffers(plan, hidden, work_weight, *ctx.needs_input_grad[:2])
            backward_pass(plan, ctx.batch, ctx.saved_coefs, grad_loss.to(plan.dtype),
                          _logits_source(hidden, work_weight, dtype),
                          _grad_sink(hidden, work_weight, d_hidden, d_weight, dtype))
            grad_loss = None
        return (finish_grad(d_hidden, grad_loss, hidden_dtype), finish_grad(d_weight, grad_loss, weight_dtype),
                None, None)


def fused_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (already mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum)."""
    return _FusedTopKKL.apply(hidden, weight, plan, batch)
