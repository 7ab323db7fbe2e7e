"""Vocab-parallel top-K extraction of a teacher's next-token distribution.

Math (per token, logits z ∈ R^V at the cache temperature τ_c, i.e. z = logits / τ_c)::

    LSE(z)      = M + log Σ_v exp(z_v − M),          M = max_v z_v
    ℓ_k         = z_{I_k} − LSE(z)                   (log-probs over the FULL vocab)
    I           = the K ids with the largest z, ordered by (z desc, id asc)

Under tensor parallelism rank r holds z[r·V_p : (r+1)·V_p] (``[s, b, V/tp]``). Rank r takes its
local top-min(K, V_p) (same order), all ranks all-gather their ``tp·K`` candidates (values and
global ids), and every rank takes the global top-K of the candidates. The LSE combines the local
ones, L_r = LSE(z_r): M = all-reduce MAX of L_r, LSE(z) = M + log(all-reduce SUM of exp(L_r − M)).
The ``[s, b, V]`` grid is never gathered. Ties are broken by the lower global id, so the result equals the top-K of the
gathered logits bit for bit, at any TP size.

Shapes: logits ``[s, b, V/tp]`` (any leading shape works); outputs ``[s, b, K]`` and ``[s, b]``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class TeacherTopK(NamedTuple):
    """One micro-batch of teacher top-K, identical on every TP rank.

    ids: int64 ``[s, b, K]`` global vocab ids, ordered by (log-prob desc, id asc).
    logprobs: float32 ``[s, b, K]`` log-probs normalised over the full vocab.
    logsumexp: float32 ``[s, b]`` the full-vocab LSE of the tempered logits.
    finite: bool ``[s, b]`` False where the token's logits (on any rank) hold a NaN or +inf, or a −inf
        inside the top-K.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    logsumexp: torch.Tensor
    finite: torch.Tensor


def group_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def combine_logsumexp(lse: torch.Tensor, tp_group) -> torch.Tensor:
    """The full-vocab LSE from each rank's local LSE ``[...]`` of its vocab shard (see the module docstring).

    M = all-reduce MAX of the local LSEs (0 where it is not finite), LSE = M + log(all-reduce SUM exp(L_r − M)).
    Returns ``lse`` itself without TP.
    """
    if group_size(tp_group) == 1:
        return lse
    global_max = lse.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    global_max = torch.where(torch.isfinite(global_max), global_max, torch.zeros((), dtype=lse.dtype))
    sum_exp = torch.exp(lse - global_max)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
    return global_max + torch.log(sum_exp)


def topk_by_value_then_id(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` along the last dim ordered by (value desc, index asc); deterministic under ties.

    ``torch.topk`` picks an arbitrary subset of values tied at the K-th place. It is asked for K+1: rows whose
    K-th and (K+1)-th values differ are unambiguous and only get their K entries stably re-sorted; the
    (rare) rows with a tie across the boundary are redone with a stable full sort.
    Shape: values ``[..., N]`` -> (values ``[..., k]``, indices int64 ``[..., k]``).
    """
    n = values.shape[-1]
    vals, idx = torch.topk(values, min(k + 1, n), dim=-1, sorted=True)          # [..., k+1]
    ambiguous = vals[..., k - 1] == vals[..., k] if k < n else None
    vals, idx = vals[..., :k], idx[..., :k]
    order = torch.argsort(idx, dim=-1)                                           # index asc ...
    vals, idx = vals.gather(-1, order), idx.gather(-1, order)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices      # ... then value desc
    vals, idx = vals.gather(-1, order), idx.gather(-1, order)
    if ambiguous is not None and bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        full = torch.sort(values[rows], dim=-1, descending=True, stable=True)
        vals[rows], idx[rows] = full.values[..., :k], full.indices[..., :k]
    return vals, idx


def vocab_parallel_topk(logits: torch.Tensor, k: int, *, temperature: float = 1.0,
                        tp_group=None) -> TeacherTopK:
    """Top-K ids, full-vocab log-probs and LSE from vocab-parallel logits ``[s, b, V/tp]``.

    ``temperature`` is the cache temperature τ_c (logits are divided by it in float32). With
    ``tp_group`` None or of size 1 no communication happens. Two passes over the logits: top-(K+1) and
    the local logsumexp; the global LSE combines the local ones (all-reduce MAX, then SUM of exp(lse_r − M)).
    A token is flagged non-finite when its LSE or one of its top-K logits is NaN/±inf (a NaN or +inf logit
    anywhere makes the LSE non-finite; a −inf logit only matters inside the top-K).
    See the module docstring.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tp = group_size(tp_group)
    vocab_local = logits.shape[-1]
    if k > vocab_local * tp:
        raise ValueError(f"k={k} exceeds the vocabulary size {vocab_local * tp}")
    z = logits.float() / temperature if temperature != 1.0 else logits.float()  # [s, b, V/tp]
    vals, idx = topk_by_value_then_id(z, min(k, vocab_local))                    # [s, b, k_loc]
    lse = combine_logsumexp(torch.logsumexp(z, dim=-1), tp_group)               # [s, b]
    if tp > 1:
        idx = idx + dist.get_rank(tp_group) * vocab_local                        # global ids
        vals_all = [torch.empty_like(vals) for _ in range(tp)]
        idx_all = [torch.empty_like(idx) for _ in range(tp)]
        dist.all_gather(vals_all, vals.contiguous(), group=tp_group)
        dist.all_gather(idx_all, idx.contiguous(), group=tp_group)
        cand_vals = torch.cat(vals_all, dim=-1)                                  # [s, b, tp·k_loc]
        cand_idx = torch.cat(idx_all, dim=-1)
        # candidates are in rank order and each rank's block in (value desc, id asc) order, so a
        # stable descending sort by value breaks ties by global id.
        order = torch.sort(cand_vals, dim=-1, descending=True, stable=True).indices[..., :k]
        vals, idx = cand_vals.gather(-1, order), cand_idx.gather(-1, order)      # [s, b, K]
    finite = torch.isfinite(lse) & torch.isfinite(vals).all(dim=-1)              # [s, b]
    return TeacherTopK(ids=idx, logprobs=vals - lse.unsqueeze(-1), logsumexp=lse, finite=finite)


def top_p_mask(logprobs: torch.Tensor, top_p: float, min_k: int) -> torch.Tensor:
    """bool ``[..., K]``: which of the ranked top-K slots (log-probs ``[..., K]`` in rank order, log-prob desc) a
    top-p row keeps (the module docstring's rule): slot k iff the mass of the slots before it is below ``top_p``, or
    k < ``min_k``."""
    p = logprobs.double().exp()                                                  # [..., K]
    before = torch.cat([torch.zeros_like(p[..., :1]), p[..., :-1].cumsum(-1)], dim=-1)
    rank = torch.arange(p.shape[-1], device=p.device)
    return (before < top_p) | (rank < min_k)


def id_ordered(ids: torch.Tensor, logprobs: torch.Tensor, keep: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) ``[..., K]`` of ranked rows (``[..., K]``, log-prob desc) as a store holds them: sorted
    ascending by id, the slots ``keep`` (bool ``[..., K]``; None: all) drops made padding, id 0 with log-prob -inf,
    first in the row."""
    if keep is not None:
        ids = torch.where(keep, ids, -1)
        logprobs = torch.where(keep, logprobs, -torch.inf)
    ids, order = ids.sort(dim=-1, stable=True)    # stable: the padding before a kept id 0, every run alike
    return ids.clamp(min=0), logprobs.gather(-1, order)


def vocab_parallel_label_logprobs(logits: torch.Tensor, labels: torch.Tensor, logsumexp: torch.Tensor, *,
                                  temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """float32 ``[s, b]``: z_y − LSE(z) of each token's label y (global ids ``[s, b]``), z = logits / τ_c.

    The rank owning y's shard gathers z_y (the others 0); an all-reduce SUM gives it to every rank. ``logsumexp``
    ``[s, b]`` is LSE(z) over the full vocab (``vocab_parallel_topk``'s).
    """
    vocab_local = logits.shape[-1]
    start = 0 if group_size(tp_group) == 1 else dist.get_rank(tp_group) * vocab_local
    local = labels.to(logits.device).long() - start
    owned = (local >= 0) & (local < vocab_local)
    picked = logits.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1).float() / temperature
    picked = torch.where(owned, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    if group_size(tp_group) > 1:
        dist.all_reduce(picked, group=tp_group)
    return picked - logsumexp.float()
