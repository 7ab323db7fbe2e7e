"""Every torch-version branch of the package, on CPU, under the versions it must meet (issue 32, item 5).

The package has one: ``loss/fused_head.py``'s ``half_into_fp32_gemm`` (how a bf16 product is added into an fp32 dX / dW
on CUDA; ``grep -rn "torch_version\\|__version__" megatron_kd_plugin``). The lent H200 runs torch 2.11.0+cu130,
this machine 2.14: both take ``addmm``, which the suite otherwise meets only on meta tensors. Here ``_mm_into_``
runs with VALUES: real bf16 CPU tensors, with torch's CUDA ``out_dtype`` kernels stood in for by fp32 products
that keep those kernels' dtype contract of that version (``addmm`` into an fp32 ``self`` raises before 2.10, as
torch 2.9.1's CUDA kernel does), so each branch's arithmetic and calls are checked against float64.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.loss import fused_head
from megatron_kd_plugin.loss.fused_head import _mm_into_, half_into_fp32_gemm

LENT_MACHINE = "2.11.0+cu130"


def _cuda_out_dtype_kernels(monkeypatch, version):
    """torch.mm / torch.addmm with ``out_dtype`` as CUDA's under torch ``version``, on CPU tensors (fp32 products of
    the half inputs, fp32 out); every call recorded as (op, self dtype, a's shape, out_dtype)."""
    calls, real_mm, real_addmm = [], torch.mm, torch.addmm
    old = torch.torch_version.TorchVersion(version) < (2, 10)

    def mm(a, b, *, out_dtype=None, out=None):
        calls.append(("mm", None, tuple(a.shape), out_dtype))
        if out_dtype is None:
            return real_mm(a, b, out=out) if out is not None else real_mm(a, b)
        assert a.dtype == b.dtype == torch.bfloat16 and out_dtype == torch.float32
        product = real_mm(a.float(), b.float())
        return out.copy_(product) if out is not None else product

    def addmm(self, a, b, *, out_dtype=None, out=None):
        calls.append(("addmm", self.dtype, tuple(a.shape), out_dtype))
        assert out_dtype is not None, "the loss reaches addmm only with out_dtype"
        if old and self.dtype != b.dtype:
            raise RuntimeError(f"self and mat2 must have the same dtype, but got {self.dtype} and {b.dtype}")
        if self.dtype not in (out_dtype, a.dtype):
            raise RuntimeError("self dtype must match either out_dtype or mat1 dtype")
        return out.copy_(self + real_mm(a.float(), b.float()))

    monkeypatch.setattr(fused_head, "half_into_fp32_gemm", lambda device_type: half_into_fp32_gemm("cuda", version))
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    return calls


@pytest.mark.parametrize("version,branch", [(LENT_MACHINE, "addmm"), ("2.14.1+cu130", "addmm"),
                                            ("2.10.0", "addmm"), ("2.9.1", "mm"), ("2.7.1", "half")])
@pytest.mark.parametrize("accumulate", [True, False], ids=["dW_accumulate", "dX_write"])
def test_half_into_fp32_with_values_under_each_version(monkeypatch, version, branch, accumulate):
    """out [V, H] fp32 (+)= G [V, c] bf16 @ X [c, H] bf16 under torch ``version`` as on CUDA: the branch it takes, its
    calls (one addmm / mm into out from 2.10, incl. the lent machine's 2.11; blocks of rows no larger than G before),
    and the values: float64 of the same bf16 inputs, within fp32 accumulation (the half branch: bf16 products)."""
    assert half_into_fp32_gemm("cuda", version) == branch
    calls = _cuda_out_dtype_kernels(monkeypatch, version)
    v, c, h = 96, 4, 32
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(v, c, generator=gen).bfloat16(), torch.randn(c, h, generator=gen).bfloat16()
    out = torch.randn(v, h, generator=gen)
    expected = (out.double() if accumulate else 0) + a.double() @ b.double()
    _mm_into_(out, a, b, accumulate=accumulate)
    assert out.dtype == torch.float32
    bound = (2 ** -7 if branch == "half" else 1e-6) * float(expected.abs().max())
    assert float((out.double() - expected).abs().max()) <= bound, (version, branch)
    if branch == "addmm":
        assert calls == [("addmm" if accumulate else "mm", torch.float32 if accumulate else None, (v, c),
                          torch.float32)], calls
    elif branch == "mm":
        assert all(op == "mm" and dtype == torch.float32 for op, _, _, dtype in calls), calls
        assert sum(shape[0] for _, _, shape, _ in calls) == v and max(s[0] for _, _, s, _ in calls) * h <= v * c
    else:
        assert all(dtype is None for *_, dtype in calls), calls      # products in bf16, no out_dtype kernel


def test_the_lent_machines_branch_would_break_torch_2_9(monkeypatch):
    """The stand-in can tell: forcing the addmm branch under 2.9.1's kernel contract raises, as on such a GPU."""
    _cuda_out_dtype_kernels(monkeypatch, "2.9.1")
    monkeypatch.setattr(fused_head, "half_into_fp32_gemm", lambda device_type: "addmm")
    out = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="same dtype"):
        _mm_into_(out, torch.ones(8, 2).bfloat16(), torch.ones(2, 4).bfloat16(), accumulate=True)


@pytest.mark.parametrize("version", [LENT_MACHINE, "2.9.1", "2.6.0"])
def test_cpu_and_meta_take_half_under_every_version(version):
    """Only CUDA has the out_dtype kernels: every other device adds a half product, whatever the version."""
    assert half_into_fp32_gemm("cpu", version) == half_into_fp32_gemm("meta", version) == "half"
