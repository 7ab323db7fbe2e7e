"""Divergences between a teacher P and a student Q on a set of buckets, and their gradient w.r.t. log Q.

Shape: ``log_p``, ``log_q``, ``present`` are [..., B]; a bucket b counts only where ``present[..., b]``.

    forward_kl:  f = sum_b P_b (log P_b - log Q_b)                 df/dlog Q_b = -P_b
    reverse_kl:  f = sum_b Q_b (log Q_b - log P_b)                 df/dlog Q_b = Q_b (log Q_b - log P_b + 1)
    jsd (beta):  f = beta KL(P || M) + (1 - beta) KL(Q || M),      df/dlog Q_b = (1 - beta) Q_b (log Q_b - log M_b)
                 M = beta P + (1 - beta) Q

Terms with a zero probability in front (0 log 0) are 0. The value is written so autograd through it is finite
(the dense reference differentiates it); the fused paths use ``bucket_divergence_grad`` instead.
"""

from __future__ import annotations

import math

import torch


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log M = log(beta P + (1 - beta) Q), computed in log space."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


def bucket_divergence(log_p: torch.Tensor, log_q: torch.Tensor, present: torch.Tensor, divergence: str,
                      beta: float) -> torch.Tensor:
    """Per-row divergence [...] summed over the present buckets of [..., B] (lean in temporaries: the dense
    reference calls it on [T, V] grids). ``log_p`` carries no gradient and is -inf on absent buckets."""
    zero = log_q.new_zeros(())
    if divergence == "forward_kl":                             # sum P log P - sum P log Q, 0 log 0 = 0
        p = log_p.exp()                                        # also where Q underflows to 0 (log Q = -inf)
        return torch.xlogy(p, p).sum(-1) - (p * torch.where(present & (p > 0), log_q, zero)).sum(-1)
    log_p = torch.where(present, log_p, zero)
    log_q = torch.where(present, log_q, zero)
    p, q = log_p.exp(), log_q.exp()
    has_p, has_q = present & (p > 0), present & (q > 0)
    if divergence == "reverse_kl":
        terms = torch.where(has_q, q * (log_q - log_p), zero)
    elif divergence == "jsd":
        log_m = _log_mixture(log_p, log_q, beta)
        terms = (beta * torch.where(has_p, p * (log_p - log_m), zero)
                 + (1.0 - beta) * torch.where(has_q, q * (log_q - log_m), zero))
    else:
        raise ValueError(f"divergence={divergence!r}: expected forward_kl, reverse_kl or jsd")
    return terms.sum(-1)


def bucket_divergence_grad(log_p: torch.Tensor, log_q: torch.Tensor, present: torch.Tensor, divergence: str,
                           beta: float) -> torch.Tensor:
    """df/dlog Q_b [..., B] (0 on absent buckets)."""
    zero = log_q.new_zeros(())
    if divergence == "forward_kl":
        return torch.where(present, -log_p.exp(), zero)
    q = log_q.exp()
    has_q = present & (q > 0)
    if divergence == "reverse_kl":
        return torch.where(has_q, q * (log_q - log_p + 1.0), zero)
    if divergence == "jsd":
        return torch.where(has_q, (1.0 - beta) * q * (log_q - _log_mixture(log_p, log_q, beta)), zero)
    raise ValueError(f"divergence={divergence!r}: expected forward_kl, reverse_kl or jsd")
