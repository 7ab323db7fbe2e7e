"""Per-chunk operations of the fused loss, with a Triton fast path on CUDA and a PyTorch path everywhere.

    from megatron_kd_plugin.kernels import chunk_row_stats, chunk_logit_grad_

    row_max, row_sumexp, gathered = chunk_row_stats(logits, ids, scale)             # [c], [c], [c, J] fp32
    chunk_logit_grad_(logits, lse, dense_coef, ids, sparse_coef, scale)              # logits <- dL/dlogits

The math is in ``megatron_kd_plugin.kernels.reference`` (the PyTorch path and the kernels' baseline); the Triton
kernels are in ``megatron_kd_plugin.kernels.triton_kernels``. ``kernels="auto"`` picks Triton when it can run
(triton importable and the logits on CUDA, or CPU logits with ``TRITON_INTERPRET=1``), else PyTorch;
``"triton"`` insists on Triton, ``"torch"`` on PyTorch.
"""

from __future__ import annotations

import torch

from megatron_kd_plugin.kernels import reference
from megatron_kd_plugin.kernels.runtime import KERNELS, interpreting, triton_importable, use_triton

__all__ = ["KERNELS", "chunk_logit_grad_", "chunk_row_stats", "interpreting", "triton_importable", "use_triton"]

def _check(logits: torch.Tensor, ids: torch.Tensor, name: str = "ids") -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a 2-D float tensor [c, Vp], got {tuple(logits.shape)} {logits.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError(f"logits: expected a contiguous last dimension, got strides {logits.stride()}")
    if ids.dim() != 2 or ids.shape[0] != logits.shape[0] or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32/int64 [c={logits.shape[0]}, ...], got {tuple(ids.shape)} "
                         f"{ids.dtype}")


def _per_token(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(value.shape)}")
    return value.float().contiguous()


def chunk_row_stats(logits: torch.Tensor, ids: torch.Tensor, scale: float, *, exclude: torch.Tensor | None = None,
                    kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_max [c], row_sumexp [c], gathered [c, J]) of u = scale * logits, fp32 (math: ``reference``).

    Shape: logits [c, Vp] (this rank's vocab shard, any float dtype), ids [c, J] local columns, -1 = not here;
    exclude [c, E] local columns left out of row_sumexp, -1 = none, any order.
    """
    _check(logits, ids)
    if exclude is not None:
        _check(logits, exclude, "exclude")
    if use_triton(logits, kernels):
        from megatron_kd_plugin.kernels import triton_kernels
        if exclude is not None:
            exclude = exclude.sort(dim=-1).values.contiguous()  # the kernel finds a tile's ids by counting
        return triton_kernels.chunk_row_stats(logits, ids.contiguous(), scale, exclude)
    return reference.chunk_row_stats(logits, ids, scale, exclude=exclude)


def chunk_logit_grad_(logits: torch.Tensor, lse: torch.Tensor, dense_coef: torch.Tensor, ids: torch.Tensor,
                      sparse_coef: torch.Tensor, scale: float, *, ce_lse: torch.Tensor | None = None,
                      ce_coef: torch.Tensor | None = None, kernels: str = "auto") -> torch.Tensor:
    """Overwrite ``logits`` in place with dL/dlogits in its own dtype and return it (math: ``reference``).

    Shape: logits [c, Vp], lse / dense_coef / ce_lse / ce_coef [c], ids / sparse_coef [c, J].
    """
    _check(logits, ids)
    if (ce_lse is None) != (ce_coef is None):
        raise ValueError("ce_lse and ce_coef go together: pass both or neither")
    c, J = ids.shape
    lse, dense_coef = _per_token("lse", lse, (c,)), _per_token("dense_coef", dense_coef, (c,))
    sparse_coef = _per_token("sparse_coef", sparse_coef, (c, J))
    if ce_coef is not None:
        ce_lse, ce_coef = _per_token("ce_lse", ce_lse, (c,)), _per_token("ce_coef", ce_coef, (c,))
    if use_triton(logits, kernels):
        from megatron_kd_plugin.kernels import triton_kernels
        return triton_kernels.chunk_logit_grad_(logits, lse, dense_coef, ids.contiguous(), sparse_coef, scale,
                                                ce_lse=ce_lse, ce_coef=ce_coef)
    return reference.chunk_logit_grad_(logits, lse, dense_coef, ids, sparse_coef, scale, ce_lse=ce_lse,
                                       ce_coef=ce_coef)
