"""The Triton kernels compile for the GPU (Hopper, sm_90) on any machine: triton ships ptxas, so no GPU is needed.

The interpreter (tests/test_kernels.py) checks the kernels' numbers on CPU but not that they compile; this checks
that every constexpr variant lowers to a cubin, with the argument types a launch on bf16 logits produces.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron_kd_plugin.kernels import triton_kernels  # noqa: E402

F32, I64 = "*fp32", "*i64"
KERNELS = [
    (triton_kernels._row_stats,
     dict(logits_ptr="*bf16", ids_ptr=I64, exclude_ptr=I64, max_ptr=F32, sumexp_ptr=F32, gathered_ptr=F32, Vp="i32",
          J="i32", E="i32", span="i32", n_splits="i32", stride_logits="i32", stride_ids="i32", stride_exclude="i32",
          scale="fp32"),
     [dict(HAS_EXCLUDE=flag, BLOCK_V=8192, BLOCK_J=64) for flag in (False, True)]),
    (triton_kernels._dense_grad,
     dict(logits_ptr="*bf16", lse_ptr=F32, dense_ptr=F32, ce_lse_ptr=F32, ce_coef_ptr=F32, Vp="i32",
          stride_logits="i32", scale="fp32"),
     [dict(HAS_CE=flag, BLOCK_V=4096) for flag in (False, True)]),
    (triton_kernels._grad_at_ids,
     dict(logits_ptr="*bf16", ids_ptr=I64, sparse_ptr=F32, lse_ptr=F32, dense_ptr=F32, ce_lse_ptr=F32, ce_coef_ptr=F32,
          out_ptr=F32, J="i32", stride_logits="i32", stride_ids="i32", scale="fp32"),
     [dict(HAS_CE=flag, BLOCK_J=64) for flag in (False, True)]),
    (triton_kernels._scatter_at_ids,
     dict(logits_ptr="*bf16", ids_ptr=I64, values_ptr=F32, J="i32", stride_logits="i32", stride_ids="i32"),
     [dict(BLOCK_J=64)]),
]


@pytest.mark.parametrize(("fn", "signature", "variants"), KERNELS, ids=[k[0].__name__ for k in KERNELS])
def test_kernel_compiles_for_sm90(monkeypatch, fn, signature, variants):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton.jit must build a compilable JITFunction
    for constexprs in variants:
        source = ASTSource(fn=triton.jit(fn), signature={**signature, **{k: "constexpr" for k in constexprs}},
                           constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm["cubin"], (fn.__name__, constexprs)
