"""Cross-tokenizer distillation: approximate likelihood matching (ALM; Minixhofer, Vulić, Ponti 2025, arXiv
2503.20083) of chunk likelihoods, on the student's lm_head shard without [T, V] logits. The math, once:

Shapes: T = s * b student tokens, H hidden, V/tp this rank's vocab shard; the per-token inputs are [s, b].
    l_t = log q(y_t) = r_{y_t} - logsumexp(r)         [T]   the student's log-prob of its realised label (tau = 1),
                                                            r = X W^T; 0 for a label IGNORE_INDEX
    chunk c of sample b: the student tokens t with chunk_ids[t] = c (same b), n_c of them,
    s_c = sum_{t in c} l_t                            [C]   the student's chunk log-likelihood
    t_c = teacher_chunk_logprobs[c, b]                [C]   the teacher's (the sum of its realised log-probs in c)
Binarised f-divergence at temperature tau (the paper's; tokenkit's ``binary_ce`` is its forward KL up to a
teacher-only constant): each chunk is a Bernoulli event "the chunk's bytes come next",
    P_c = (p, 1 - p),  p = exp(min(t_c / tau, -eps));    Q_c = (q, 1 - q),  q = exp(min(s_c / tau, -eps))
    D_c = divergence(P_c, Q_c) on the two buckets (``divergence.py``: forward_kl = p log(p/q) + (1-p) log((1-p)/(1-q)),
          reverse_kl, jsd), eps = 1e-6 keeps log(1 - q) finite
Token-level term (optional, weight gamma = ``token_weight``): at a pair token t (its label and the teacher's
realised token are the only tokens of their chunk and the same string; ``cache.align``) the teacher's top-K,
mapped to the student's ids of identical strings (``teacher_ids``, ``teacher_logprobs``: -inf for a slot with no
such id, and on every slot of a token that is not a pair), is a top-K teacher for the student's next token; with
the ghost tail and no temperature (``token_math``: the K + 1 buckets, the unmapped mass in the tail)
    f_t = divergence(P_t, Q_t) over the buckets                [T]   0 where every slot is -inf (P = Q = tail)
    P = the counted tokens with a mapped slot;  U = the tokens of the used chunks
Each token's alpha-mix, as in the same-tokenizer loss, over the teacher signals that cover it: its coverage
kappa_t = (1 - gamma) [t in U] + gamma [t in P] in [0, 1] goes to them, the rest to its own CE (a token no teacher
signal covers keeps plain CE):
    loss_sum = alpha (1 - gamma) sum_c n_c D_c + alpha gamma sum_t w_t f_t + sum_t w_t (1 - alpha kappa_t) (-l_t)
    (w = loss_mask; CE at tau = 1)                 num_tokens = #{t : w_t != 0}
gamma = 0 is ALM alone. Chunk terms count only tokens with w_t != 0 (a chunk with one masked token drops out whole).
Gradient: with g_t = d loss_sum / d l_t (alpha (1 - gamma) n_c dD_c/ds_c, minus (1 - alpha kappa_t) w_t) and h_t = d
loss_sum / d f_t (alpha gamma w_t), d r_t = -g_t (softmax(r) - onehot(y_t)) + h_t df_t/dr: the fused chunk loop's CE
and KD coefficients (``token_math``) kept apart in one pass (``vocab_loop.PerToken``) and scaled per token. The chunk
math is O(T) autograd on the all-reduced l and f (identical on every TP rank); the vocab work is the fused chunk loop
in its ``recompute`` mode (g_t is known only in backward): one pass over the logits forms both terms.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .divergence import bucket_divergence
from .fused import _block_rows, _gemm_dtype, _grad_buffers, _grad_sink, _logits_source
from .main_grad import main_grad_of
from .options import KDLossOptions
from .plan import IGNORE_INDEX, LossPlan, finish_grad, input_grads, prepare_batch, use_triton_kernels
from .tp import hidden_to_tp_region, resolve_shard
from .validate import check_shapes, check_values
from .vocab_loop import PerToken, backward_pass, forward_pass

EPS = 1e-6


class ChunkLossResult(NamedTuple):
    """What ``chunk_likelihood_loss`` returns (sums over counted tokens / used chunks)."""

    loss_sum: torch.Tensor
    """Differentiable: the module docstring's loss_sum."""
    num_tokens: torch.Tensor
    """int64: tokens with a non-zero loss_mask."""
    chunk_sum: torch.Tensor
    """Detached: sum_c n_c D_c."""
    ce_sum: torch.Tensor
    """Detached: sum_t w_t (-l_t)."""
    num_chunks: torch.Tensor
    """Detached: the used chunks C."""
    chunk_gap_sum: torch.Tensor
    """Detached: sum_c |t_c - s_c| (nats), how far the chunk log-likelihoods are apart."""
    token_sum: torch.Tensor
    """Detached: sum_t w_t f_t, the token-level term (0 without it)."""
    num_pairs: torch.Tensor
    """Detached: counted tokens with at least one mapped teacher slot (0 without the token-level term)."""


class _TokenTerms(torch.autograd.Function):
    """(hidden [T, H], weight [V/tp, H]) -> (l [T], f [T]): each token's label log-prob and token-level KD value
    (module docstring); backward scales each token's two gradients by their own incoming gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: LossPlan, batch):
        need_dx, need_dw = input_grads(ctx, plan)
        ctx.plan, ctx.batch, ctx.input_dtypes = plan, batch, (hidden.dtype, weight.dtype)
        ctx.main_grad = main_grad_of(weight, plan.dtype, plan.accumulate_main_grad) if need_dw else None
        values = PerToken(hidden.new_zeros(hidden.shape[0], dtype=plan.dtype),
                          hidden.new_zeros(hidden.shape[0], dtype=plan.dtype))
        logits = _logits_source(hidden, weight, _gemm_dtype(plan, hidden, weight), _block_rows(plan, weight))
        _, ctx.saved_coefs = forward_pass(plan, batch, logits, None, keep_coefs=need_dx or need_dw, per_token=values)
        ctx.save_for_backward(hidden, weight)
        return values.ce.neg_(), values.kd

    @staticmethod
    def backward(ctx, grad_logprobs, grad_kd):
        hidden, weight = ctx.saved_tensors
        plan, main_grad = ctx.plan, ctx.main_grad
        ctx.main_grad = None
        dtype = _gemm_dtype(plan, hidden, weight)
        block_rows = _block_rows(plan, weight)
        d_hidden, d_weight = _grad_buffers(plan, hidden, weight, dtype, *ctx.needs_input_grad[:2], main_grad)
        backward_pass(plan, ctx.batch, ctx.saved_coefs, grad_kd.to(plan.dtype),
                      _logits_source(hidden, weight, dtype, block_rows),
                      _grad_sink(hidden, weight, d_hidden, d_weight, dtype, block_rows),
                      ce_scale=-grad_logprobs.to(plan.dtype))                     # d l / d r = -d ce / d r
        hidden_dtype, weight_dtype = ctx.input_dtypes
        weight_grad = main_grad.placeholder_grad() if main_grad is not None else finish_grad(d_weight, None,
                                                                                              weight_dtype)
        return finish_grad(d_hidden, None, hidden_dtype), weight_grad, None, None


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-x.exp()), torch.log(-torch.expm1(x)))


def binarised_divergence(teacher: torch.Tensor, student: torch.Tensor, *, divergence: str, jsd_beta: float,
                         temperature: float) -> torch.Tensor:
    """D_c [C] of chunk log-likelihoods t_c, s_c [C] (module docstring)."""
    log_p = (teacher / temperature).clamp(max=-EPS)
    log_q = (student / temperature).clamp(max=-EPS)
    buckets_p = torch.stack([log_p, _log1mexp(log_p)], -1)                   # [C, 2]
    buckets_q = torch.stack([log_q, _log1mexp(log_q)], -1)
    return bucket_divergence(buckets_p, buckets_q, torch.ones_like(buckets_p, dtype=torch.bool), divergence, jsd_beta)


def chunk_likelihood_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor,
                          teacher_chunk_logprobs: torch.Tensor, *, loss_mask: torch.Tensor | None = None,
                          teacher_ids: torch.Tensor | None = None, teacher_logprobs: torch.Tensor | None = None,
                          token_weight: float = 0.0, divergence: str = "forward_kl", jsd_beta: float = 0.5,
                          temperature: float = 1.0, alpha: float = 1.0, chunk_bytes: int | None = None,
                          kernels: str = "auto", tp_group=None, sequence_parallel: bool = False,
                          accumulate_main_grad: bool = True) -> ChunkLossResult:
    """The ALM chunk-likelihood loss, and optionally the token-level term, (module docstring) of a student lm_head
    against a cross-tokenizer teacher.

    Shapes: hidden [s, b, H] ([s/tp, b, H] with sequence_parallel), weight [V/tp, H] (this rank's vocab shard),
    labels int [s, b] (global ids, IGNORE_INDEX = -100: none), chunk_ids int [s, b] (the chunk of each label within
    its sample, -1: none), teacher_chunk_logprobs float [s, b] (entry [c, b] = t_c of sample b's chunk c; rows
    beyond its chunks unused), loss_mask [s, b] (default 1); with ``token_weight`` > 0: teacher_ids int [s, b, K]
    (the teacher's top-K mapped to the student's global ids) and teacher_logprobs float [s, b, K] (-inf: an
    unmapped slot, and every slot of a token that is not a pair). Every TP rank returns the same sums; hidden's
    gradient is all-reduced (reduce-scattered with sequence_parallel) by megatron-core's mappings, dW goes to the
    weight's fp32 ``main_grad`` when it has one (``accumulate_main_grad``). ``divergence`` / ``jsd_beta`` /
    ``temperature`` / ``alpha`` / ``chunk_bytes`` / ``kernels`` mean what they do in ``KDLossOptions``: on the
    two-bucket chunk events, and (divergence, jsd_beta) on the token-level buckets, which are not tempered; the
    vocab work of the one pass runs on the Triton kernels where ``kernels`` resolves to them (``auto``: CUDA, or the
    CPU interpreter; not float64).
    """
    KDLossOptions(divergence=divergence, jsd_beta=jsd_beta, temperature=temperature, alpha=alpha)   # validates
    if not 0.0 <= token_weight <= 1.0:
        raise ValueError(f"token_weight={token_weight!r}: expected 0 <= token_weight <= 1")
    with_tokens = token_weight > 0.0
    if with_tokens and (teacher_ids is None or teacher_logprobs is None):
        raise ValueError(f"token_weight={token_weight} needs teacher_ids and teacher_logprobs (the pairs' top-K in "
                         "the student's ids)")
    options = KDLossOptions(tail="ghost", divergence=divergence, jsd_beta=jsd_beta, alpha=1.0,
                            chunk_bytes=chunk_bytes, kernels=kernels)
    shard = resolve_shard(tp_group, weight.shape[0])
    seq = hidden.shape[0] * (shard.size if sequence_parallel else 1)
    tokens = (seq, hidden.shape[1])
    for name, value in (("labels", labels), ("chunk_ids", chunk_ids), ("teacher_chunk_logprobs",
                                                                       teacher_chunk_logprobs), ("loss_mask", loss_mask)):
        if value is not None and tuple(value.shape) != tokens:
            raise ValueError(f"{name} must be [s, b] = {tokens}, got {tuple(value.shape)}")
    if weight.dim() != 2 or weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V/tp, H={hidden.shape[-1]}] of hidden's dtype {hidden.dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if loss_mask is None:
        loss_mask = torch.ones(tokens, dtype=torch.float32, device=hidden.device)
    counted = (loss_mask != 0).reshape(-1)
    flat_labels = torch.where(counted, labels.reshape(-1).long(), IGNORE_INDEX)
    if with_tokens:
        check_shapes(hidden, weight, teacher_ids, teacher_logprobs, loss_mask, labels, None, options, shard,
                     sequence_parallel)
        check_values(teacher_ids, teacher_logprobs, loss_mask, labels, None, options, shard.vocab_size)
        k = teacher_ids.shape[-1]
        slot_ids = teacher_ids.reshape(-1, k)
        slot_logprobs = torch.where(counted[:, None], teacher_logprobs.reshape(-1, k), -torch.inf)
    else:                                                                 # no teacher slots: l only
        slot_ids = torch.zeros(counted.shape[0], 0, dtype=torch.long, device=hidden.device)
        slot_logprobs = slot_ids.to(torch.float32)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    triton = use_triton_kernels(kernels, hidden)
    plan = LossPlan(options=options, shard=shard, dtype=dtype, with_labels=True, triton=triton,
                    logits_dtype=torch.promote_types(hidden.dtype, weight.dtype) if triton else None,
                    accumulate_main_grad=accumulate_main_grad, grad_enabled=torch.is_grad_enabled())
    batch = prepare_batch(plan, slot_ids, slot_logprobs, torch.ones_like(counted, dtype=dtype), flat_labels)
    hidden2d = hidden_to_tp_region(hidden, shard, sequence_parallel).reshape(-1, hidden.shape[-1])   # [T, H]
    logprobs, token_kd = _TokenTerms.apply(hidden2d, weight, plan, batch)                  # [T] l, [T] f
    weights = loss_mask.reshape(-1).to(dtype)
    ce_sum = -(weights * logprobs).sum()
    token_sum = (weights * token_kd).sum()
    # chunk sums: sample b's chunk c -> flat index c * b_size + b ([s, b] order, like the tokens)
    batch_size = tokens[1]
    samples = torch.arange(batch_size, device=hidden.device).repeat(tokens[0])
    flat_ids = chunk_ids.reshape(-1).long()
    in_chunk = flat_ids >= 0
    target = torch.where(in_chunk, flat_ids * batch_size + samples, 0)
    num_slots = tokens[0] * batch_size
    student = torch.zeros(num_slots, dtype=dtype, device=hidden.device).index_add(
        0, target, torch.where(in_chunk, logprobs, 0.0))
    sizes = torch.zeros(num_slots, dtype=dtype, device=hidden.device).index_add(0, target, in_chunk.to(dtype))
    dropped = torch.zeros(num_slots, dtype=dtype, device=hidden.device).index_add(
        0, target, (in_chunk & ~counted).to(dtype))
    used = (sizes > 0) & (dropped == 0)                                                      # [s * b] chunk slots
    teacher = teacher_chunk_logprobs.reshape(-1).to(dtype)
    d = binarised_divergence(torch.where(used, teacher, -1.0), torch.where(used, student, -1.0),
                             divergence=divergence, jsd_beta=jsd_beta, temperature=temperature)
    chunk_sum = torch.where(used, sizes * d, 0.0).sum()
    paired = counted & batch.teacher.valid.any(-1)                                          # [T] t in P
    coverage = (1.0 - token_weight) * (in_chunk & used[target]).to(dtype) + token_weight * paired.to(dtype)
    loss_sum = alpha * ((1.0 - token_weight) * chunk_sum + token_weight * token_sum) - \
        (weights * (1.0 - alpha * coverage) * logprobs).sum()
    gap = torch.where(used, (teacher - student).abs(), 0.0).sum()
    pairs = paired.sum().to(dtype)
    return ChunkLossResult(loss_sum, torch.count_nonzero(counted).to(torch.int64), chunk_sum.detach(),
                           ce_sum.detach(), used.sum().to(dtype), gap.detach(), token_sum.detach(), pairs)
