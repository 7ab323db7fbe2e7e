"""The fused loss's CUDA-only choices, checked on CPU (issue 19, items 1, 2 and 4): the half-into-fp32 dW GEMM taken
by torch version, no gradient work under ``torch.no_grad()``, and the renorm K-rows path without fp32 copies of W."""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.loss import fused
from megatron_kd_plugin.loss.fused import _mm_into_, half_into_fp32_gemm


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

    monkeypatch.setattr(fused, "half_into_fp32_gemm",
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
