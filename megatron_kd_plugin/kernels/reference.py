"""The two per-chunk operations of the fused loss in plain PyTorch: the CPU path and the Triton kernels' baseline.

The math (written once, here; ``docs/how-it-works/kernels.md`` derives why every loss option fits it).
Shapes: c tokens in the chunk, Vp = V/tp columns of this rank's vocab shard, J gathered ids per token.

    logits      [c, Vp]  raw X_c W_pᵀ of this shard, any float dtype; u = scale * logits in fp32, scale = 1/tau
    ids         [c, J]   int32/int64 LOCAL columns in [0, Vp); -1 = this id is not on this shard; duplicates allowed

``chunk_row_stats(logits, ids, scale, *, exclude=None) -> (row_max [c], row_sumexp [c], gathered [c, J])``, fp32:

    row_max[t]     = max_j u[t, j]
    row_sumexp[t]  = sum_{j not in exclude[t]} exp(u[t, j] - row_max[t])       (exclude [c, E] local ids, -1 = none)
    gathered[t, k] = u[t, ids[t, k]]   if ids[t, k] >= 0 else 0

Under TP the caller all-reduces them into the global log-sum-exp:
M = MAX_r row_max_r, lse = M + log SUM_r row_sumexp_r exp(row_max_r - M). With ``exclude`` = the teacher's support
the same all-reduce gives the ghost tail's sum directly, without the cancellation of 1 - sum_k q_{I_k}.

``chunk_logit_grad_(logits, lse, dense_coef, ids, sparse_coef, scale, *, ce_lse=None, ce_coef=None) -> logits``
overwrites ``logits`` IN PLACE, in its own dtype, with dL/dlogits:

    G[t, j] = scale * (dense_coef[t] * exp(u[t, j] - lse[t]) + sum_{k: ids[t, k] == j} sparse_coef[t, k])
              + ce_coef[t] * exp(logits[t, j] - ce_lse[t])          (only when ce_coef is given)

    lse [c] fp32 is the GLOBAL (all-vocab, all-reduced) log-sum-exp of u; dense_coef [c], sparse_coef [c, J] fp32;
    ids -1 contribute nothing. The optional second softmax is the hard-label CE at temperature 1 when tau != 1
    (ce_lse from ``chunk_row_stats(logits, labels, 1.0)``); its one-hot part goes into sparse_coef divided by scale.
"""

from __future__ import annotations

import torch


def chunk_row_stats(logits: torch.Tensor, ids: torch.Tensor, scale: float, *,
                    exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row max, row sum-exp (off ``exclude``) and the values at ``ids`` of u = scale * logits (module docstring)."""
    u = logits.float() * scale  # [c, Vp]
    row_max = u.amax(dim=-1)  # [c]
    e = (u - row_max[:, None]).exp_()  # [c, Vp]
    if exclude is not None:  # -1 goes to a spare column Vp, dropped
        excluded = torch.zeros(e.shape[0], e.shape[1] + 1, dtype=torch.bool, device=e.device)
        excluded.scatter_(1, torch.where(exclude >= 0, exclude.long(), e.shape[1]), True)
        e.masked_fill_(excluded[:, :-1], 0.0)
    row_sumexp = e.sum(dim=-1)  # [c]
    present = ids >= 0  # [c, J]
    gathered = u.gather(1, ids.clamp(min=0).long()).masked_fill_(~present, 0.0)  # [c, J]
    return row_max, row_sumexp, gathered


def chunk_logit_grad_(logits: torch.Tensor, lse: torch.Tensor, dense_coef: torch.Tensor, ids: torch.Tensor,
                      sparse_coef: torch.Tensor, scale: float, *, ce_lse: torch.Tensor | None = None,
                      ce_coef: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrite ``logits`` with dL/dlogits (see the module docstring) and return it."""
    x = logits.float()  # [c, Vp]
    grad = (x * scale - lse[:, None]).exp_().mul_(dense_coef[:, None])  # [c, Vp]
    present = ids >= 0  # [c, J]
    grad.scatter_add_(1, ids.clamp(min=0).long(), sparse_coef.float().masked_fill(~present, 0.0))
    grad.mul_(scale)
    if ce_coef is not None:
        grad.add_((x - ce_lse[:, None]).exp_().mul_(ce_coef[:, None]))
    return logits.copy_(grad)
