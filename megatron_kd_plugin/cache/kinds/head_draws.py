"""Head + draws rows (``cache --head H --draws N``, issue #40): per token the teacher's exact top-H ids, then N ids
drawn from the teacher restricted to the rest of the vocabulary, and the estimator the loss forms from them.

Math (per token; p the teacher's distribution over the full vocab V at the cache temperature, l_v = log p_v, q the
student's, H the head: the H most probable ids, ordered as ``topk.py``; T = V \\ H the tail, m = Σ_{v∈H} p_v)::

    head      (h_1..h_H, l_{h_1}..l_{h_H})          exact (``topk.vocab_parallel_topk``)
    draws     i_1..i_N iid from p(v | T) = p_v / (1 − m), v ∈ T     (``draws.vocab_parallel_draws`` on the logits
              with the head's set to −inf: its inverse-CDF draws, same uniforms per (seed, sample), any TP size)
    stored    l_{i_n} = log p(i_n | T) + log(1 − m), the full-vocab log-prob (LSE(z_T) − LSE(z) = log(1 − m))
    weights   w_{h_j} = p_{h_j},    w_{i_n} = (1 − m) / N             (:func:`head_draw_weights`)

The rows are a ``loss.SampledTeacher`` (ids, log-probs, weights): the loss's ``tail="sampled"`` estimator

    f = Σ_k w_k (l_k − log q_{I_k}),        ∂f/∂z = q · Σ_k w_k − Σ_k w_k e_{I_k} = q − P̂,   Σ_k w_k = 1

(z the student's logits, e_v the unit vector, P̂_v = Σ_{k: I_k = v} w_k). Its head part is exact; its tail part is
unbiased: E[(1 − m)/N Σ_n (l_{i_n} − log q_{i_n})] = (1 − m) Σ_{v∈T} p(v | T) (l_v − log q_v) = Σ_{v∈T} p_v (l_v −
log q_v), and likewise E[P̂_v] = p_v on T, so E[f] = KL(p ‖ q) and E[∂f/∂z] = q − p, its gradient: the head spends no
slot re-drawing the mass that top-K keeps exactly, the draws see the tail that top-K cannot. Where the head holds all
the mass (1 − m underflows to 0) the draws weigh 0 and the row is the top-H row. Proposal temperature 1 only (the
tail's draws follow p itself); codec: the draws' (``format.DEFAULT_DRAWS_CODEC``), whose rounding of l moves m and so
every weight, consistently (the weights sum to 1 after decoding).

Shapes: logits ``[s, b, V/tp]``, uniforms ``[s, b, N]``; rows ``[s, b, H + N]``: the head sorted by id, then the
draws sorted by id (repeats kept).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_kd_plugin.cache.kinds.draws import vocab_parallel_draws
from megatron_kd_plugin.cache.kinds.topk import group_size, vocab_parallel_topk


class HeadDraws(NamedTuple):
    """One micro-batch of head + draws rows, identical on every TP rank.

    ids: int64 ``[s, b, H + N]`` the head's ids (sorted), then the drawn ids (sorted, repeats kept).
    logprobs: float32 ``[s, b, H + N]`` their full-vocab log-probs at the cache temperature.
    logsumexp: float32 ``[s, b]`` LSE(z), the full-vocab LSE of the tempered logits.
    finite: bool ``[s, b]`` False where the token's logits (on any rank) hold a NaN or +inf.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    logsumexp: torch.Tensor
    finite: torch.Tensor


def vocab_parallel_head_draws(logits: torch.Tensor, uniforms: torch.Tensor, head: int, *, temperature: float = 1.0,
                              tp_group=None) -> HeadDraws:
    """The head + draws rows of vocab-parallel logits ``[s, b, V/tp]`` (module docstring); ``uniforms``
    ``[s, b, N]`` in [0, 1), the same on every TP rank. Work buffers: a head-masked float32 copy of the logits,
    then the draws' (the fused head, ``teacher_head.py``, bounds them by handing blocks of tokens)."""
    top = vocab_parallel_topk(logits, head, temperature=temperature, tp_group=tp_group)
    rank = dist.get_rank(tp_group) if group_size(tp_group) > 1 else 0
    vocab_local = logits.shape[-1]
    local = top.ids - rank * vocab_local                                         # [s, b, H] this shard's columns
    in_shard = (local >= 0) & (local < vocab_local)
    masked = logits.float().clone()                                              # [s, b, V/tp]
    drop = torch.where(in_shard, -torch.inf, torch.inf)                          # min(z, -inf) at the head's ids
    masked.scatter_reduce_(-1, local.clamp(0, vocab_local - 1), drop, reduce="amin")
    draws = vocab_parallel_draws(masked, uniforms, temperature=temperature, tp_group=tp_group)
    del masked
    tail_log_mass = draws.logsumexp.double() - top.logsumexp.double()            # [s, b] log(1 - m)
    draw_logprobs = (draws.logprobs.double() + tail_log_mass.unsqueeze(-1)).float()
    head_ids, order = top.ids.sort(dim=-1)
    return HeadDraws(ids=torch.cat([head_ids, draws.ids], -1),
                     logprobs=torch.cat([top.logprobs.gather(-1, order), draw_logprobs], -1),
                     logsumexp=top.logsumexp, finite=top.finite & draws.finite)


def head_draw_weights(logprobs: torch.Tensor, head: int) -> torch.Tensor:
    """float32 weights ``[..., H + N]`` of head + draws rows' log-probs ``[..., H + N]``: p at the head's slots,
    (1 − m) / N at each draw (module docstring); 0 at a slot of log-prob −inf (the padding of a token the loss does
    not read)."""
    probs = logprobs.double().exp()
    tail_mass = (1.0 - probs[..., :head].sum(-1, keepdim=True)).clamp_min(0.0)          # [..., 1] 1 - m
    draws = logprobs.shape[-1] - head
    weights = torch.cat([probs[..., :head], (tail_mass / draws).expand(*logprobs.shape[:-1], draws)], -1)
    return torch.where(logprobs > -torch.inf, weights, 0.0).float()
