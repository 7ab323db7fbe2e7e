"""The fused loss's CUDA-only choices, checked on CPU (issue 19, items 1, 2 and 4): the half-into-fp32 dW GEMM taken
by torch version, no gradient work under ``torch.no_grad()``, and the renorm K-rows path without fp32 copies of W."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_kd_plugin.loss import fused_head, references, topk_kd_loss
from megatron_kd_plugin.loss.fused_head import _mm_into_, half_into_fp32_gemm
from tests.test_loss_helpers import make_case, rel_err, run_loss, teacher_of


@pytest.mark.parametrize("device_type,version,expected", [
    ("cuda", "2.14.1+cu130", "addmm"), ("cuda", "2.10.0", "addmm"), ("cuda", "2.11.0+cu128", "addmm"),
    ("cuda", "2.10.0a0+git1234", "mm"),      # a 2.10 pre-release may predate pytorch PR 167931
    ("cuda", "2.9.1", "mm"), ("cuda", "2.8.0", "mm"), ("cuda", "2.7.1", "half"), ("cuda", "2.6.0", "half"),
    ("cpu", "2.14.1", "half"), ("meta", "2.14.1", "half")])
def test_half_into_fp32_gemm_by_version(device_type, version, expected):
    """addmm into an fp32 ``self`` only where torch's CUDA kernel accepts it (2.10.0 on); torch 2.8 / 2.9 take
    mm with out_dtype, older torch and other devices a half product added in fp32."""
    assert half_into_fp32_gemm(device_type, version) == expected


def _as_if_cuda(monkeypatch, version):
    """Let meta tensors (which have torch's out_dtype kernels' shape and dtype checks) stand in for CUDA ones under
    torch ``version``; record every addmm / mm call with its argument dtypes."""
    calls = []
    real_gemm, real_addmm, real_mm = half_into_fp32_gemm, torch.addmm, torch.mm

    def addmm(self, a, b, **kw):
        calls.append(("addmm", self.dtype, a.dtype, b.dtype, kw.get("out_dtype"), tuple(a.shape)))
        if kw.get("out_dtype") is not None and self.dtype != b.dtype and torch.torch_version.TorchVersion(version) < (2, 10):
            raise RuntimeError(f"self and mat2 must have the same dtype, but got {self.dtype} and {b.dtype}")
        with monkeypatch.context() as inner:    # the meta kernel's own torch.mm is not the loss's call
            inner.setattr(torch, "mm", real_mm)
            return real_addmm(self, a, b, **kw)

    def mm(a, b, **kw):
        calls.append(("mm", None, a.dtype, b.dtype, kw.get("out_dtype"), tuple(a.shape)))
        return real_mm(a, b, **kw)

    monkeypatch.setattr(fused_head, "half_into_fp32_gemm",
                        lambda device_type: real_gemm("cuda" if device_type == "meta" else device_type, version))
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(torch, "mm", mm)
    return calls


@pytest.mark.parametrize("version", ["2.9.1", "2.10.0"])
def test_bf16_dw_accumulation_dispatch_on_cuda(monkeypatch, version):
    """dW [V, H] fp32 += G^T [V, c] bf16 @ X [c, H] bf16 as on CUDA: torch 2.9 must not reach addmm with an fp32
    self (its kernel raises) and forms the fp32 product in blocks of rows no larger than G (never a [V, H]
    temporary); torch 2.10 makes one in-place addmm."""
    calls = _as_if_cuda(monkeypatch, version)
    v, c, h = 96, 4, 32
    out = torch.empty(v, h, device="meta")
    grad_t, x = torch.empty(v, c, dtype=torch.bfloat16, device="meta"), torch.empty(c, h, dtype=torch.bfloat16,
                                                                                     device="meta")
    _mm_into_(out, grad_t, x, accumulate=True)
    if version == "2.10.0":
        assert calls == [("addmm", torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, (v, c))]
    else:
        assert calls and all(call[0] == "mm" and call[4] == torch.float32 for call in calls), calls
        assert sum(call[5][0] for call in calls) == v and max(call[5][0] for call in calls) * h <= v * c, calls


@pytest.mark.parametrize("shape", [(96, 4, 32), (5, 64, 3)])
def test_half_into_fp32_blocks_match_float64(shape):
    """The block-wise fallback (CPU's path) adds the whole product: equal to float64 within bf16 products."""
    v, c, h = shape
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(v, c, generator=gen).bfloat16(), torch.randn(c, h, generator=gen).bfloat16()
    out = torch.randn(v, h, generator=gen)
    ref = out.double() + a.double() @ b.double()
    _mm_into_(out, a, b, accumulate=True)
    assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided}


class _LargeAllocations(TorchDispatchMode):
    """Records (op, dtype, shape) of every op output of at least ``numel`` elements in new memory (views and
    in-place results share an input's storage and are not counted)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _storages((args, kwargs))
        out = func(*args, **kwargs)
        for tensor in torch.utils._pytree.tree_leaves(out):
            if (isinstance(tensor, torch.Tensor) and tensor.numel() >= self.numel
                    and tensor.untyped_storage().data_ptr() not in inputs):
                self.seen.append((func.__name__, tensor.dtype, tuple(tensor.shape)))
        return out


def _loss(case, hidden, weight, **options):
    return topk_kd_loss(hidden, weight, teacher_of(case), loss_mask=case["loss_mask"],
                        kernels="torch", **options)


FUSED_PATHS = [dict(impl="fused", mode="recompute"), dict(impl="fused", mode="grad_in_forward"),
               dict(impl="forward_chunked")]


@pytest.mark.parametrize("path", FUSED_PATHS, ids=lambda p: p.get("mode", p["impl"]))
def test_no_gradient_work_under_no_grad(monkeypatch, path):
    """Under torch.no_grad() (Bridge's evaluation) with inputs that require grad: no logits gradient (so no dX, dW)
    and no per-token coefficients kept; the loss equals the one with grad mode on. With grad on, the same spy sees
    the gradient work (the test can tell)."""
    case = make_case(s=2, b=5, hidden_size=16, vocab=64, k=4, dtype=torch.float32)
    hidden, weight = case["hidden"].requires_grad_(), case["weight"].requires_grad_()
    calls = []
    module = references if path["impl"] == "forward_chunked" else fused_head
    real = module.forward_pass

    def spy(plan, batch, logits_chunk, on_grad, keep_coefs):
        calls.append((on_grad is not None, keep_coefs))
        return real(plan, batch, logits_chunk, on_grad, keep_coefs)

    monkeypatch.setattr(module, "forward_pass", spy)
    with torch.no_grad():
        evaluated = _loss(case, hidden, weight, **path)
    assert calls == [(False, False)], calls
    calls.clear()
    trained = _loss(case, hidden, weight, **path)
    assert calls and calls[0] != (False, False), calls
    assert torch.equal(evaluated.loss_sum, trained.loss_sum.detach())


@pytest.mark.parametrize("path", [dict(impl="fused", mode="grad_in_forward"), dict(impl="fused", tail="renorm")],
                         ids=["grad_in_forward", "renorm_rows"])
def test_no_weight_sized_buffers_under_no_grad(path):
    """No [V, H] (dW) and no [T, H] (dX) buffer in an eval forward of the paths that form gradients in forward; with
    grad on they appear (the counter can tell). T*H and V*H are the largest sizes in play (K*c*H chunks below)."""
    case = make_case(s=4, b=16, hidden_size=32, vocab=96, k=4, dtype=torch.float32)   # T*H = 2048, V*H = 3072
    hidden, weight = case["hidden"].requires_grad_(), case["weight"].requires_grad_()
    options = dict(path, chunk_bytes=4 * 32 * 4 * 3)
    with torch.no_grad(), _LargeAllocations(64 * 32) as seen:
        _loss(case, hidden, weight, **options)
    assert seen.seen == [], seen.seen
    with _LargeAllocations(64 * 32) as seen:
        _loss(case, hidden, weight, **options)
    assert {shape for _, _, shape in seen.seen} >= {(64, 32), (96, 32)}, seen.seen


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_renorm_rows_casts_only_gathered_rows(frozen):
    """tail='renorm' on bf16 X [T, H] and W [V, H]: no fp32 (or any new) tensor as large as W or X is made beside the
    gradient being formed (dX [T, H] when W is frozen, dW [V, H] when X is): the K rows W[I] of one chunk of tokens
    are gathered and cast at a time. Loss and gradients equal the float64 dense loss on the same bf16 values."""
    case = make_case(s=4, b=16, hidden_size=32, vocab=96, k=4, dtype=torch.float64)   # T*H = 2048, V*H = 3072
    hidden, weight = case["hidden"].bfloat16(), case["weight"].bfloat16()
    chunk_bytes = 3 * 4 * 32 * (2 + 2 * 4)                   # 3 tokens: [3, K, H] rows, fp32 casts and products
    ref, ref_dh, ref_dw = run_loss(case, hidden=hidden.double(), weight=weight.double(), impl="dense", tail="renorm",
                                   temperature=1.5)
    hidden.requires_grad_(frozen != "hidden")
    weight.requires_grad_(frozen != "weight")
    with _LargeAllocations(32 * 32) as seen:                 # anything of >= 1/2 X or 1/3 W
        got = topk_kd_loss(hidden, weight, teacher_of(case), loss_mask=case["loss_mask"],
                           tail="renorm", temperature=1.5, chunk_bytes=chunk_bytes)
        got.loss_sum.backward()
    expected = {"weight": [(torch.float32, (64, 32)), (torch.bfloat16, (64, 32))],          # dX, then as bf16
                "hidden": [(torch.float32, (96, 32)), (torch.bfloat16, (96, 32))]}[frozen]  # dW, then as bf16
    assert [(dtype, shape) for _, dtype, shape in seen.seen] == expected, seen.seen
    assert rel_err(got.loss_sum, ref.loss_sum) < 1e-5
    grad, ref_grad = (hidden.grad, ref_dh) if frozen == "weight" else (weight.grad, ref_dw)
    assert rel_err(grad, ref_grad) < 2 ** -7                 # rounded once to bf16
