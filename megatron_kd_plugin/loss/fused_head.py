"""The fused lm_head: X [T, H] and this rank's lm_head shard W [V/tp, H] in, a KD loss out, with no [T, V/tp] logits.

Never materialises [T, V/tp] logits: per chunk of c tokens r_c = X_c W^T lives in one [c, V/tp] buffer (fp32 on
the PyTorch chunk backend; the inputs' dtype, e.g. bf16, with the Triton kernels) that becomes the chunk's logits
gradient G_c in place, then dX_c = G_c W and dW += G_c^T X_c. ``recompute`` keeps only per-token coefficients
(T*K) and recomputes r_c in backward (4 products per chunk); ``grad_in_forward`` forms dX and dW during forward and
only scales them in backward (3 products). dW is accumulated in fp32 straight into megatron-core DDP's
``weight.main_grad`` when the weight has one (``MainGrad`` below; ``recompute`` then holds no dW buffer at all). A half
weight meets the fp32 PyTorch backend in converted blocks of rows, never as a full fp32 copy. Peak extra memory
~ c * V/tp * 4 B (x2 for CE at tau != 1; Triton: one chunk in the inputs' dtype) + dX (T*H) + dW (V/tp*H, fp32;
none in ``recompute`` into main_grad) + ~10 B per teacher slot (``KDBatch``), flat in T apart from dX and the slots.
The per-chunk vocab work is ``chunk_backends``' (PyTorch or Triton, ``options.kernels``).

Two autograd Functions run the head over the shared chunk loop (``chunk_loop``): ``fused_topk_kl`` (the top-K
loss: summed figures, backward scaled by one incoming gradient) and ``fused_token_values`` (per-token label
log-probs and KD values, each token's two gradients scaled by their own incoming gradients: the cross-tokenizer
loss). ``input_grads`` / ``finish_grad`` / ``formed_grads`` / ``loss_totals`` are shared by every loss Function of
the package.

``MainGrad``, megatron-core's gradient-accumulation convention for the lm_head weight: dW goes straight into DDP's
main_grad. megatron-core's DDP gives every parameter ``main_grad`` (a view of its fp32 gradient buffer) and a flag
``grad_added_to_main_grad``; its backward hook adds ``param.grad`` into ``main_grad`` unless the flag is set, then
drops ``param.grad`` (``distributed_data_parallel.py``, ``_make_backward_post_hook``). Its own linear layers
(``LinearWithGradAccumulationAndAsyncCommunication`` with gradient_accumulation_fusion) accumulate dW into
``main_grad`` themselves, set the flag, and return a placeholder grad whose values are never read (an uninitialised
``torch.empty``; zeros when ``zero_out_wgrad`` marks a weight tied to the embedding, whose grad DDP does add).

The fused loss does the same, without apex and whatever ``gradient_accumulation_fusion`` says (it needs no fused
kernel): dW is accumulated in fp32 into ``main_grad``, never rounded to the weight's bf16 nor held in a second
[V/tp, H] buffer. Its placeholder costs no memory: a detached alias of the weight (DDP discards it unread), or None
for a tied weight (the embedding's grad is then ``param.grad``, which DDP adds), for a weight without the flag
(megatron's convention without DDP's hook), and when ``weight.grad`` is still set (nothing dropped the previous
placeholder: autograd would add the new one into it in place, i.e. into the weight).
"""

from __future__ import annotations

import dataclasses

import torch

from .chunk_loop import PerToken, backward_pass, forward_pass
from .loss_plan import KDBatch, LossPlan


@dataclasses.dataclass(frozen=True)
class MainGrad:
    """The weight and its ``main_grad`` buffer [V/tp, H] (the loss's accumulation dtype)."""

    weight: torch.Tensor
    """The lm_head weight (the Parameter itself, which carries DDP's attributes)."""
    buffer: torch.Tensor
    """``weight.main_grad``."""

    def placeholder_grad(self) -> torch.Tensor | None:
        """Mark dW as added (DDP then skips it) and return what backward returns for the weight."""
        if not hasattr(self.weight, "grad_added_to_main_grad"):
            return None
        self.weight.grad_added_to_main_grad = True
        if getattr(self.weight, "zero_out_wgrad", False) or self.weight.grad is not None:
            return None             # a grad still there (no DDP hook dropped it) would be accumulated in place
        return self.weight.detach()


def main_grad_of(weight: torch.Tensor, dtype: torch.dtype, enabled: bool) -> MainGrad | None:
    """``weight``'s main_grad when dW should be accumulated there: ``enabled``, the weight needs a gradient and has a
    ``main_grad`` of the loss's accumulation ``dtype`` (fp32; a bf16 main_grad is left to DDP: dW is returned) that
    is not Megatron-FSDP's (allocated lazily by its own hooks)."""
    buffer = getattr(weight, "main_grad", None)
    if (not enabled or buffer is None or not weight.requires_grad or buffer.dtype != dtype
            or hasattr(weight, "__fsdp_param__")):
        return None
    if buffer.shape != weight.shape:
        raise ValueError(f"weight.main_grad has shape {tuple(buffer.shape)}, the weight {tuple(weight.shape)}")
    return MainGrad(weight, buffer)


def input_grads(ctx, plan: LossPlan) -> tuple[bool, bool]:
    """(dX needed, dW needed) for a loss Function's forward: an input requires grad and grad mode was on at the call.
    ``ctx.needs_input_grad`` alone is not enough: it follows ``requires_grad`` even under ``torch.no_grad()``, and
    inside ``Function.forward`` grad mode is always off."""
    return plan.grad_enabled and ctx.needs_input_grad[0], plan.grad_enabled and ctx.needs_input_grad[1]


def finish_grad(grad: torch.Tensor | None, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Scale (grad_in_forward) in place and cast to the input's dtype. A half ``grad`` is scaled in fp32 (a 0-dim
    fp32 ``scale`` keeps the op's math in fp32) and rounded once."""
    if grad is None:
        return None
    if scale is not None:
        grad.mul_(scale if grad.dtype in (torch.float16, torch.bfloat16) else scale.to(grad.dtype))
    return grad.to(dtype)


def formed_grads(ctx, grad_loss: torch.Tensor, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of a loss whose (d hidden, d weight) were formed in forward (``ctx.grads``, with ``ctx.main_grad``
    and ``ctx.input_dtypes``): both scaled by ``grad_loss``, dW added into DDP's ``main_grad`` where it has one.
    They are handed over once: a second backward of the same forward is a RuntimeError naming the loss."""
    if ctx.grads == ():
        raise RuntimeError(f"{name} supports one backward per forward")
    (d_hidden, d_weight), ctx.grads = ctx.grads, ()
    main_grad, ctx.main_grad = ctx.main_grad, None
    hidden_dtype, weight_dtype = ctx.input_dtypes
    if main_grad is not None and d_weight is not None:
        main_grad.buffer.add_(d_weight.mul_(grad_loss.to(d_weight.dtype)))
        weight_grad = main_grad.placeholder_grad()
    else:
        weight_grad = finish_grad(d_weight, grad_loss, weight_dtype)
    return finish_grad(d_hidden, grad_loss, hidden_dtype), weight_grad


def loss_totals(ctx, plan: LossPlan, totals: torch.Tensor):
    """[kd_sum, ce_sum, mass_sum, the report groups' sums (G * 2)] -> (loss_sum, kd_sum, ce_sum, mass_sum as fp32
    scalars (float64 for float64), group sums [G, 2]: each group's kd and ce sums), the outputs of every loss
    Function's forward; only loss_sum is differentiable (``ctx`` is that Function's)."""
    options = plan.options
    kd_sum, ce_sum, mass_sum = (t.clone() for t in totals[:3].unbind())
    groups = totals[3:].reshape(-1, 2).clone()
    loss_sum = options.alpha * options.temperature ** 2 * kd_sum + (1.0 - options.alpha) * ce_sum
    ctx.mark_non_differentiable(kd_sum, ce_sum, mass_sum, groups)
    return loss_sum, kd_sum, ce_sum, mass_sum, groups


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


def _save_for_recompute(ctx, hidden, weight, plan: LossPlan, batch: KDBatch) -> tuple[bool, bool]:
    """What a head Function's forward keeps for backward: the plan, batch and input dtypes, the weight's
    ``main_grad`` when dW goes there; returns (dX needed, dW needed)."""
    need_dx, need_dw = input_grads(ctx, plan)
    ctx.plan, ctx.batch, ctx.saved_coefs, ctx.input_dtypes = plan, batch, None, (hidden.dtype, weight.dtype)
    ctx.main_grad = main_grad_of(weight, plan.dtype, plan.accumulate_main_grad) if need_dw else None
    return need_dx, need_dw


def _recompute_backward(ctx, grad_scale: torch.Tensor, ce_scale: torch.Tensor | None = None):
    """``recompute``'s backward: each chunk's logits again, its gradient scaled by ``grad_scale`` (the CE
    coefficients of a per-token pass by ``ce_scale``) into dX and dW (into ``main_grad`` when the weight has one).
    Returns (d hidden, d weight) in the inputs' dtypes."""
    hidden, weight = ctx.saved_tensors
    plan, main_grad = ctx.plan, ctx.main_grad
    ctx.main_grad = None
    dtype, block_rows = _gemm_dtype(plan, hidden, weight), _block_rows(plan, weight)
    d_hidden, d_weight = _grad_buffers(plan, hidden, weight, dtype, *ctx.needs_input_grad[:2], main_grad)
    backward_pass(plan, ctx.batch, ctx.saved_coefs, grad_scale, _logits_source(hidden, weight, dtype, block_rows),
                  _grad_sink(hidden, weight, d_hidden, d_weight, dtype, block_rows), ce_scale=ce_scale)
    hidden_dtype, weight_dtype = ctx.input_dtypes
    weight_grad = main_grad.placeholder_grad() if main_grad is not None else finish_grad(d_weight, None,
                                                                                          weight_dtype)
    return finish_grad(d_hidden, None, hidden_dtype), weight_grad


class _FusedTopKKL(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (loss_sum, kd_sum, ce_sum, student_mass_sum, group sums [G, 2]).

    dW goes into ``weight.main_grad`` (``MainGrad``) when ``plan.accumulate_main_grad`` finds one; ``recompute`` then
    accumulates each chunk's dW there directly, ``grad_in_forward`` adds its held dW scaled by the incoming gradient
    in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch: KDBatch):
        need_dx, need_dw = _save_for_recompute(ctx, hidden, weight, plan, batch)
        dtype, block_rows = _gemm_dtype(plan, hidden, weight), _block_rows(plan, weight)
        logits_chunk = _logits_source(hidden, weight, dtype, block_rows)
        ctx.grads = None
        if plan.options.mode == "grad_in_forward" and (need_dx or need_dw):
            ctx.grads = _grad_buffers(plan, hidden, weight, dtype, need_dx, need_dw, None)
            totals, _ = forward_pass(plan, batch, logits_chunk, _grad_sink(hidden, weight, *ctx.grads, dtype,
                                                                           block_rows), keep_coefs=False)
        else:
            totals, ctx.saved_coefs = forward_pass(plan, batch, logits_chunk, None, keep_coefs=need_dx or need_dw)
            if need_dx or need_dw:
                ctx.save_for_backward(hidden, weight)
        return loss_totals(ctx, plan, totals)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            return *_recompute_backward(ctx, grad_loss.to(ctx.plan.dtype)), None, None
        return *formed_grads(ctx, grad_loss, "the fused KD loss (grad_in_forward)"), None, None


def fused_topk_kl(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan, batch: KDBatch):
    """hidden [T, H] (already mapped into the TP region), weight [V/tp, H] -> (loss_sum, kd_sum, ce_sum, mass_sum,
    group sums [G, 2])."""
    return _FusedTopKKL.apply(hidden, weight, plan, batch)


class _FusedTokenValues(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (l [T], f [T]): each token's label log-prob and KD value
    (``fused_token_values``); backward scales each token's two gradients by their own incoming gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch):
        need_dx, need_dw = _save_for_recompute(ctx, hidden, weight, plan, batch)
        values = PerToken(hidden.new_zeros(hidden.shape[0], dtype=plan.dtype),
                          hidden.new_zeros(hidden.shape[0], dtype=plan.dtype))
        logits = _logits_source(hidden, weight, _gemm_dtype(plan, hidden, weight), _block_rows(plan, weight))
        _, ctx.saved_coefs = forward_pass(plan, batch, logits, None, keep_coefs=need_dx or need_dw, per_token=values)
        ctx.save_for_backward(hidden, weight)
        return values.ce.neg_(), values.kd

    @staticmethod
    def backward(ctx, grad_logprobs, grad_kd):                                # d l / d r = -d ce / d r
        return *_recompute_backward(ctx, grad_kd.to(ctx.plan.dtype), -grad_logprobs.to(ctx.plan.dtype)), None, None


def fused_token_values(hidden: torch.Tensor, weight: torch.Tensor, plan: LossPlan,
                       batch: KDBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] (mapped into the TP region), weight [V/tp, H] -> (l [T] each token's label log-prob at tau = 1,
    f [T] its KD value tau^2 f_t), from one recompute-mode pass over the logits chunks (a per-token pass of
    ``chunk_loop``); backward scales each token's CE and KD gradients by their own incoming gradients."""
    return _FusedTokenValues.apply(hidden, weight, plan, batch)
