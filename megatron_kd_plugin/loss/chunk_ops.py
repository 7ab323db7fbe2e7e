"""Stateless per-chunk pieces over a [c, V/tp] fp32 logits buffer; each is one kernel's worth of work.

They are the PyTorch chunk backend's (``chunk_backends.TorchChunks``); the Triton backend does the same work with
``megatron_kd_plugin.kernels``. Index inputs are this rank's: ``local_ids`` [c, K] int64 in [0, V/tp) and
``local_valid`` [c, K] bool (the slot's id lies in this shard and is a bucket); slots that are not local carry a
clamped, unused index.
"""

from __future__ import annotations

import torch


def shard_local(ids: torch.Tensor, valid: torch.Tensor, vocab_start: int,
                vocab_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids [...] -> (shard-local ids clamped into [0, V/tp), local_valid = valid and inside the shard)."""
    local = valid & (ids >= vocab_start) & (ids < vocab_end)
    return (ids - vocab_start).clamp(0, vocab_end - vocab_start - 1), local


def gather_local(z: torch.Tensor, local_ids: torch.Tensor, local_valid: torch.Tensor) -> torch.Tensor:
    """z at the local ids [c, K] (0 where not local), so a SUM all-reduce assembles the global values."""
    return torch.where(local_valid, z.gather(1, local_ids), z.new_zeros(()))


def exp_off_support_(z: torch.Tensor, shift: torch.Tensor, local_ids: torch.Tensor,
                     local_valid: torch.Tensor) -> torch.Tensor:
    """In place: z [c, V/tp] -> E = exp(z - shift[:, None]) with 0 at the support ids. Returns E."""
    z.sub_(shift[:, None]).exp_()
    keep = (~local_valid).to(z.dtype)           # multiply by 0 at support ids; repeats/non-local slots multiply by 1
    return z.scatter_reduce_(1, local_ids, keep, reduce="prod")


def logits_grad_(exp_off: torch.Tensor, dense_coef: torch.Tensor, local_ids: torch.Tensor,
                 local_support_grad: torch.Tensor, local_label: torch.Tensor | None,
                 local_label_grad: torch.Tensor | None, exp_full: torch.Tensor | None = None,
                 ce_dense_coef: torch.Tensor | None = None) -> torch.Tensor:
    """In place: E (off-support exp) [c, V/tp] -> d loss / d r [c, V/tp]. Returns it.

    dr = dense_coef[:, None] * E + ce_dense_coef[:, None] * E1 + scatter(support_grad) + scatter(label_grad);
    the scattered values must already be 0 where not local.
    """
    grad = exp_off.mul_(dense_coef[:, None])
    if exp_full is not None:
        grad.add_(exp_full.mul_(ce_dense_coef[:, None]))
    grad.scatter_add_(1, local_ids, local_support_grad)
    if local_label is not None:
        grad.scatter_add_(1, local_label[:, None], local_label_grad[:, None])
    return grad
