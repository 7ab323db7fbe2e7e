"""Fused chunked top-K KD: X [T, H] and this rank's lm_head shard W [V/tp, H] in, a scalar loss out.

Never materialises [T, V/tp] logits: per chunk of c tokens r_c = X_c W^T lives in one [c, V/tp] buffer (fp32 on
the PyTorch chunk backend; the inputs' dtype, e.g. bf16, with the Triton kernels) that becomes the chunk's logits
gradient G_c in place, then dX_c = G_c W and dW += G_c^T X_c. ``recompute`` keeps only per-token coefficients
(T*K) and recomputes r_c in backward (4 products per chunk); ``grad_in_forward`` forms dX and dW during forward and
only scales them in backward (3 products). dW is accumulated in fp32 straight into megatron-core DDP's
``weight.main_grad`` when the weight has one (``main_grad.py``; ``recompute`` then holds no dW buffer at all). A half
weight meets the fp32 PyTorch backend in converted blocks of rows, never as a full fp32 copy. Peak extra memory
~ c * V/tp * 4 B (x2 for CE at tau != 1; Triton: one chunk in the inputs' dtype) + dX (T*H) + dW (V/tp*H, fp32;
none in ``recompute`` into main_grad) + ~10 B per teacher slot (``KDBatch``), flat in T apart from dX and the slots.
The per-chunk vocab work is ``chunk_backends``' (PyTorch or Triton, ``options.kernels``)."""

from __future__ import annotations

import torch

from .main_grad import MainGrad, main_grad_of
from .plan import KDBatch, LossPlan, finish_grad, input_grads, loss_totals
from .vocab_loop import backward_pass, forward_pass


def _weight_blocks(weight: torch.Tensor, dtype: torch.dtype, block_rows: int):
    """(vocab rows, W[rows] in ``dtype``) covering the shard: the weight itself when it has ``dtype`` (no copy),
    else ``block_rows`` rows at a time converted on the fly (never a [V/tp, H] copy of a half weight)."""
    if weight.dtype == dtype:
        yield slice(0, weight.shape[0]), weight
        return
    for start in range(0, weight.shape[0], block_rows):
        rows = slice(start, min(start + block_rows, weight.shape[0]))
        yield rows, weight[rows].to(dtype)


def _logits_source(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, block_rows: int):
    def logits_chunk(rows: slice) -> torch.Tensor:
        x = hidden[rows].to(dtype)                                           # [c, H]
        if weight.dtype == dtype:
            return x @ weight.t()                                            # [c, V/tp]
        logits = x.new_empty(x.shape[0], weight.shape[0])
        for cols, w in _weight_blocks(weight, dtype, block_rows):
            logits[:, cols] = x @ w.t()
        return logits
    return logits_chunk


def half_into_fp32_gemm(device_type: str, torch_version: str = torch.__version__) -> str:
    """How ``_mm_into_`` adds a half product a @ b into an fp32 out on this device and torch:

    ``addmm``: one cuBLAS GEMM with fp32 output accumulating in place (``torch.addmm(out, a, b, out_dtype=fp32,
    out=out)``): CUDA with torch >= 2.10. Before, the CUDA kernel required ``self`` to have mat2's dtype ("self and
    mat2 must have the same dtype, but got Float and BFloat16"); pytorch PR 167931 relaxed it, first released in
    2.10.0 (its check "self dtype must match either out_dtype or mat1 dtype" is in 2.10.0's libtorch_cuda.so, not in
    2.9.1's). ``mm``: CUDA with torch 2.8 / 2.9: ``torch.mm(..., out_dtype=fp32)`` (new in 2.8) into fp32 blocks of
    rows, each added to out. ``half``: older torch or not CUDA (CPU has no ``out_dtype`` kernels): blocks of the
    product in the inputs' dtype (fp32 accumulation inside the GEMM, rounded to it), added in fp32. A pre-release
    (2.10.0a0) counts as the release before it."""
    if device_type != "cuda":
        return "half"
    version = torch.torch_version.TorchVersion(torch_version)
    if version >= (2, 10, 0):
        return "addmm"
    return "mm" if version >= (2, 8, 0) else "half"


def _mm_into_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b; a half a, b into an fp32 out as ``half_into_fp32_gemm`` says. The ``mm`` / ``half`` fallbacks
    form the product in blocks of a's rows of at most a's element count, so a [V/tp, c] x [c, H] dW product never
    holds a [V/tp, H] temporary."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    gemm = half_into_fp32_gemm(out.device.type)
    if gemm == "addmm":
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
        return
    step = max(1, a.numel() // max(1, b.shape[1]))
    for start in range(0, a.shape[0], step):
        rows = slice(start, start + step)
        product = torch.mm(a[rows], b, out_dtype=out.dtype) if gemm == "mm" else a[rows] @ b
        if accumulate:
            out[rows].add_(product)
        else:
            out[rows].copy_(product)


def _grad_sink(hidden: torch.Tensor, weight: torch.Tensor, d_hidden, d_weight, dtype: torch.dtype, block_rows: int):
    def on_grad(rows: slice, grad: torch.Tensor) -> None:                    # grad [c, V/tp]
        x = hidden[rows].to(dtype) if d_weight is not None else None        # [c, H]
        for cols, w in _weight_blocks(weight, dtype, block_rows):
            if d_hidden is not None:
                _mm_into_(d_hidden[rows], grad[:, cols], w, accumulate=cols.start > 0)   # [c, H]
            if d_weight is not None:
                _mm_into_(d_weight[cols], grad[:, cols].t(), x, accumulate=True)       # [V/tp, H]
    return on_grad


def _gemm_dtype(plan: LossPlan, hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The chunk GEMMs' dtype: the inputs' (bf16 on GPU) with the Triton kernels, else the accumulation dtype."""
    return torch.promote_types(hidden.dtype, weight.dtype) if plan.triton else plan.dtype


def _block_rows(plan: LossPlan, weight: torch.Tensor) -> int:
    """Vocab rows per converted weight block (a quarter of the chunk budget; only for half weights on the PyTorch
    chunk backend)."""
    return max(1, plan.options.budget_bytes(weight.device) // (4 * weight.shape[1] * plan.dtype.itemsize))


def _grad_buffers(plan: LossPlan, hidden: torch.Tensor, weight: torch.Tensor, gemm_dtype: torch.dtype,
                  need_dx: bool, need_dw: bool, main_grad: MainGrad | None):
    """dX [T, H] and dW [V/tp, H] (None where not needed; zeroed). dW sums over chunks in the accumulation dtype:
    into ``main_grad`` when given, else a fresh buffer. dX rows are each written once by a full-shard GEMM (fp32
    accumulation inside cuBLAS), so the Triton path writes them in the GEMM dtype."""
    d_hidden_dtype = gemm_dtype if plan.triton else plan.dtype
    d_hidden = hidden.new_zeros(hidden.shape, dtype=d_hidden_dtype) if need_dx else None
    d_weight = None
    if need_dw:
        d_weight = main_grad.buffer if main_grad is not None else weight.new_zeros(weight.shape, dtype=plan.dtype)
    return d_hidden, d_weight


class _FusedTopKKL(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (loss_sum, kd_sum, ce_sum, student_mass_sum).

    dW goes into ``weight.main_grad`` (megatron-core DDP's convention, ``main_grad.py``) when ``plan.accumulate_main_grad``
    finds one; ``recompute`` then accumulates each chunk's dW there directly, ``grad_in_forward`` adds its held dW
    scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch: KDBatch):
        dtype = _gemm_dtype(plan, hidden, weight)
        block_rows = _block_rows(plan, weight)
        need_dx, need_dw = input_grads(ctx, plan)
        ctx.plan, ctx.batch, ctx.saved_coefs = plan, batch, None
        ctx.input_dtypes = (hidden.dtype, weight.dtype)
        ctx.main_grad = main_grad_of(weight, plan.dtype, plan.accumulate_main_grad) if need_dw else None
        logits_chunk = _logits_source(hidden, weight, dtype, block_rows)
        if plan.options.mode == "grad_in_forward" and (need_dx or need_dw):
            d_hidden, d_weight = _grad_buffers(plan, hidden, weight, dtype, need_dx, need_dw, None)
            totals, _ = forward_pass(plan, batch, logits_chunk,
                                     _grad_sink(hidden, weight, d_hidden, d_weight, dtype, block_rows),
                                     keep_coefs=False)
            ctx.grads = (d_hidden, d_weight)
        else:
            totals, ctx.saved_coefs = forward_pass(plan, batch, logits_chunk, None, keep_coefs=need_dx or need_dw)
            if need_dx or need_dw:
                ctx.save_for_backward(hidden, weight)
            ctx.grads = None
        return loss_totals(ctx, plan, totals)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        hidden_dtype, weight_dtype = ctx.input_dtypes
        main_grad, ctx.main_grad = ctx.main_grad, None
        if ctx.grads is not None:                                            # grad_in_forward: scale only
            if ctx.grads == ():
                raise RuntimeError("the fused KD loss (grad_in_forward) supports one backward per forward")
            d_hidden, d_weight = ctx.grads
            ctx.grads = ()
            if main_grad is not None and d_weight is not None:
                main_grad.buffer.add_(d_weight.mul_(grad_loss.to(d_weight.dtype)))
                d_weight = None
        else:
            hidden, weight = ctx.saved_tensors
            plan = ctx.plan
            dtype = _gemm_dtype(plan, hidden, weight)
            block_rows = _block_rows(plan, weight)
            d_hidden, d_weight = _grad_buffers(plan, hidden, weight, dtype, *ctx.needs_input_grad[:2], main_grad)
            backward_pass(plan, ctx.batch, ctx.saved_coefs, grad_loss.to(plan.dtype),
                          _logits_source(hidden, weight, dtype, block_rows),
                          _grad_sink(hidden, weight, d_hidden, d_weight, dtype, block_rows))
            grad_loss = None
            if main_grad is not None:
                d_weight = None                                              # already in main_grad
        weight_grad = main_grad.placeholder_grad() if main_grad is not None else finish_grad(d_weight, grad_loss,
                                                                                              weight_dtype)
        return finish_grad(d_hidden, grad_loss, hidden_dtype), weight_grad, None, None


def fused_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (already mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum)."""
    return _FusedTopKKL.apply(hidden, weight, plan, batch)
