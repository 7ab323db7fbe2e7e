"""Vocab-parallel sampling of a teacher's next-token distribution for the sampled cache (issue #8).

Math (per token; z = logits / τ_c the tempered logits, l_v = z_v − LSE(z) the teacher's log-probs over the FULL
vocab V at the cache temperature, t the proposal temperature)::

    log q_v   = l_v / t − G,       G = logsumexp_u(l_u / t) = LSE(y) − LSE(z) / t,     y = z / t
    draws     i_1..i_N iid from q (with replacement), by inverse CDF: i_n = min{v : C_v > u_n · C_V},
              C_v = Σ_{u <= v} exp(y_u − M) (terms in float32, summed in float64), M = max_v y_v,
              u_n uniform in [0, 1)
    weights   w_n = (1/N) · p_{i_n} / q_{i_n} = (1/N) · exp(l_{i_n} · (1 − 1/t) + G)

so that P̂_v = Σ_n [i_n = v] w_n has E[P̂_v] = p_v (at t = 1 every w_n = 1/N: P̂ is the empirical count / N).

Under tensor parallelism rank r holds the contiguous shard z[r·V_p : (r+1)·V_p] (``[s, b, V/tp]``) and the
vocabulary is laid out as the shards in rank order. M is an all-reduce MAX; each rank's shard mass
T_r = Σ_{v in shard r} exp(y_v − M) is all-gathered (``[s, b, tp]``); the uniform u_n lands in the rank r with
O_r <= u_n · ΣT < O_r + T_r (O_r = Σ_{r' < r} T_r'), which resolves it inside its shard with a float64 cumsum and
searchsorted; one all-reduce SUM of the (owner-only, else 0) ids and log-probs assembles them on every rank.
LSE(z) combines the local ones as in ``topk.py``. The ``[s, b, V]`` grid is never gathered. The terms exp(y_v − M)
are the same numbers at any TP size, so the draws equal the TP=1 draws except when a u_n · ΣT falls within a few
float64 ulps of a CDF step (summation order differs), probability ~1e-15 per draw.

The uniforms are a pure function of (seed, global sample index): :func:`draw_uniforms`. Draws therefore do not
depend on the TP or DP size, the micro-batch size or a resume.

Shapes: logits ``[s, b, V/tp]``, uniforms ``[s, b, N]`` -> ids / log-probs ``[s, b, N]``, ``G`` and ``finite``
``[s, b]`` (and LSE(z) ``[s, b]``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_kd_plugin.cache.kinds.topk import group_size, combine_logsumexp


class TeacherDraws(NamedTuple):
    """N draws per token, identical on every TP rank.

    ids: int64 ``[s, b, N]`` the drawn global vocab ids, sorted ascending (duplicates kept).
    logprobs: float32 ``[s, b, N]`` l of those ids (full-vocab log-probs at the cache temperature).
    proposal_lognorm: float32 ``[s, b]`` G = logsumexp_v(l_v / t), 0 at t = 1.
    logsumexp: float32 ``[s, b]`` LSE(z), the full-vocab LSE of the tempered logits.
    finite: bool ``[s, b]`` False where the token's logits (on any rank) hold a NaN or +inf.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    proposal_lognorm: torch.Tensor
    logsumexp: torch.Tensor
    finite: torch.Tensor


def draw_uniforms(seed: int, first_sample: int, num_samples: int, seq_length: int, n: int, *,
                  first_position: int = 0) -> torch.Tensor:
    """float64 ``[seq_length, num_samples, n]`` in [0, 1): sample i's from ``numpy.random.default_rng([seed, i])``,
    positions ``first_position`` .. ``first_position + seq_length − 1`` of its stream (n per position; a block of
    positions skips the stream's earlier ones: PCG64 draws one 64-bit word per double, ``advance`` jumps them)."""
    def positions(sample: int) -> np.ndarray:
        rng = np.random.default_rng([seed, sample])
        rng.bit_generator.advance(first_position * n)
        return rng.random((seq_length, n))

    return torch.from_numpy(np.stack([positions(first_sample + i) for i in range(num_samples)], axis=1))


def draw_weights(logprobs: torch.Tensor, proposal_lognorm: torch.Tensor | None,
                   proposal_temperature: float) -> torch.Tensor:
    """float32 importance weights w ``[..., N]`` of N draws (one slot = one draw) from l ``[..., N]`` and G
    ``[...]``; a slot of log-prob −inf holds no draw (the padding of a token the loss does not read) and weighs 0.

    ``proposal_lognorm`` may be None only at t = 1 (every w = 1/N).
    """
    n, drawn = logprobs.shape[-1], logprobs > -torch.inf
    if proposal_temperature == 1.0:
        return torch.where(drawn, 1.0 / n, 0.0).float()
    if proposal_lognorm is None:
        raise ValueError(f"proposal_temperature={proposal_temperature} needs the proposal log-normaliser")
    log_ratio = logprobs.double() * (1.0 - 1.0 / proposal_temperature) + proposal_lognorm.double().unsqueeze(-1)
    return torch.where(drawn, torch.exp(log_ratio) / n, 0.0).float()


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[..., 1]``: the last index along the last dim where ``mask`` ``[..., n]`` is True (n − 1 if none)."""
    return mask.shape[-1] - 1 - mask.flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)


def shard_offsets(ends: torch.Tensor) -> torch.Tensor:
    """O_r, the mass of the shards before shard r, from ``ends`` [..., tp] (O_r + T_r): the ends shifted by one, the
    very sums the owner search compares u · ΣT with, so the owner's local target u · ΣT − O_r is never below 0
    (``ends − masses`` can exceed O_r by an ulp, and a negative target would draw the shard's first id, of any
    weight, 0 included)."""
    return torch.cat([torch.zeros_like(ends[..., :1]), ends[..., :-1]], dim=-1)


def vocab_parallel_draws(logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float = 1.0,
                          proposal_temperature: float = 1.0, tp_group=None) -> TeacherDraws:
    """N draws per token from q ∝ p^(1/t) given vocab-parallel logits ``[s, b, V/tp]`` (module docstring).

    ``temperature`` is the cache temperature τ_c, ``proposal_temperature`` t; ``uniforms`` ``[s, b, N]`` in
    [0, 1) must be the same on every TP rank. No communication with ``tp_group`` None or of size 1. The work
    buffers are ~13 bytes per logit (the tempered logits, exponentiated in place, in float32 and their float64 CDF):
    the fused head (``teacher_head.py``) bounds them by handing blocks of tokens.
    """
    if temperature <= 0 or proposal_temperature <= 0:
        raise ValueError(f"temperature={temperature} and proposal_temperature={proposal_temperature} must be > 0")
    if uniforms.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"uniforms {tuple(uniforms.shape)} do not match the logits' tokens {tuple(logits.shape[:-1])}")
    tp = group_size(tp_group)
    vocab_local = logits.shape[-1]
    z = logits.float() / temperature                                             # [s, b, V/tp] float32, a copy
    lse_z = combine_logsumexp(torch.logsumexp(z, dim=-1), tp_group).double()     # [s, b]
    y = z.div_(proposal_temperature) if proposal_temperature != 1.0 else z       # in place: z is not read again
    top = y.amax(dim=-1)                                                         # [s, b]
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=top.dtype))
    weights = y.sub_(top.unsqueeze(-1)).exp_()                                  # [s, b, V/tp] exp(y − M), in place
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)                            # [s, b, V/tp]
    mass = cdf[..., -1:].contiguous()                                            # [s, b, 1] T_r
    if tp > 1:
        masses = [torch.empty_like(mass) for _ in range(tp)]
        dist.all_gather(masses, mass, group=tp_group)
        masses = torch.cat(masses, dim=-1)                                       # [s, b, tp]
        rank = dist.get_rank(tp_group)
    else:
        masses, rank = mass, 0
    ends = masses.cumsum(dim=-1)                                                 # [s, b, tp] O_r + T_r
    target = uniforms.to(device=ends.device, dtype=torch.float64) * ends[..., -1:]      # [s, b, N] u · ΣT
    owner = torch.minimum(torch.searchsorted(ends, target.contiguous(), right=True),   # [s, b, N]
                          last_index(masses > 0))                                # u · ΣT rounded up to ΣT
    local = torch.searchsorted(cdf, target - shard_offsets(ends)[..., rank:rank + 1], right=True)
    local = torch.minimum(local, last_index(weights > 0))                        # rounding past the shard's end
    mine = owner == rank
    ids = torch.where(mine, local + rank * vocab_local, 0)                       # [s, b, N] int64
    logprobs = torch.where(mine, logits.gather(-1, local).double() / temperature - lse_z.unsqueeze(-1), 0.0)
    if tp > 1:
        dist.all_reduce(ids, group=tp_group)
        dist.all_reduce(logprobs, group=tp_group)
    ids, order = ids.sort(dim=-1)
    logprobs = logprobs.gather(-1, order)
    lognorm = top.double() + torch.log(ends[..., -1]) - lse_z / proposal_temperature   # G = LSE(y) − LSE(z)/t
    if proposal_temperature == 1.0:
        lognorm = torch.zeros_like(lognorm)
    finite = torch.isfinite(lse_z) & torch.isfinite(lognorm) & torch.isfinite(logprobs).all(dim=-1)
    return TeacherDraws(ids=ids, logprobs=logprobs.float(), proposal_lognorm=lognorm.float(),
                        logsumexp=lse_z.float(), finite=finite)
