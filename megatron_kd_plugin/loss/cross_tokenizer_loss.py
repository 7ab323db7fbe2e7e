"""The cross-tokenizer loss: a student with its own tokenizer against a teacher's cached rows, on the student's
lm_head shard without [T, V] logits. A token-level term, the teacher's next-token distribution read through the
student's tokens, and approximate likelihood matching (ALM; Minixhofer, Vulić, Ponti 2025, arXiv 2503.20083) of
segment likelihoods. The math, once:

Shapes: T = s * b student tokens, H hidden, V/tp this rank's vocab shard; the per-token inputs are [s, b].
    l_t = log q(y_t) = r_{y_t} - logsumexp(r)         [T]   the student's log-prob of its realised label (tau = 1),
                                                            r = X W^T; 0 for a label IGNORE_INDEX
Token-level term (weight gamma = ``token_weight``; issue #31). The cached sample: teacher tokens x_0..x_S, token i
ending at byte e_i; at cache position t the top-K (I_k, l_k) is the teacher's distribution over x_{t+1}, and the
realised log-prob that of x_{t+1}. Student position t (its tokens end at bytes b; it has read the text up to b_t)
predicts y_t. Read the teacher at the last teacher token ending at or before b_t:
    u = max {i : e_i <= b_t},  o = b_t - e_u,  pi = the first o bytes of x_{u+1} (read by the student, not the teacher)
Candidates: the K + 1 slots at u, the top-K and the realised token x_{u+1} (slot K, unless the top-K holds it). A
candidate v is consistent when its string s_v starts with pi; it reaches the student's next token
    mu(v) = y_t for v = x_{u+1} (the realised text decides it),
            the student's first token of s_v[o:] otherwise (``cache.cross_tokenizer.first_tokens``: context-free; none
            where len(s_v) = o or the student has no such token).
The teacher's distribution over the student's next token, and the rest of its mass as the ghost bucket:
    P_t(w) = sum_{consistent v: mu(v) = w} p_v / Z_t,     Z_t = 1 at a boundary position (o = 0, every candidate is
             consistent),  Z_t = sum_{consistent v} p_v inside a teacher token (o > 0: what the slots know of the
             teacher's probability that its next token starts with pi; there at most
             ``cache.cross_tokenizer.token_slots``' MID_CANDIDATES candidates are kept, the realised one and the most
             probable others)
    P_t(ghost) = 1 - sum_w P_t(w)          (the teacher's tail, candidates reaching no student token)
A position is covered when some candidate reaches a student token (every position after the teacher's first token,
unless the realised log-prob is -inf); the rows carry the candidates (``cache.cross_tokenizer.align``:
``token_positions``, ``token_ids``, ``token_logprobs``, ``realised_logprobs``, ``realised_slots``, ``mid_ids``,
``mid_logprobs``), ``token_teacher`` expands them on the device into a top-K teacher [s, b, K + 1] in the student's ids,
and the token-level divergence is the top-K loss's with the ghost tail and no temperature (``token_math``: repeated ids
merged, the buckets and the tail):
    f_t = divergence(P_t, Q_t) over the buckets                [T]   0 where no slot is covered
    P = the counted covered tokens
Segment term (weight 1 - gamma): segment c of sample b (the bytes between two common token boundaries,
``cache.cross_tokenizer.align``): the student tokens t with segment_ids[t] = c (same b), n_c of them,
    s_c = sum_{t in c} l_t                            [C]   the student's segment log-likelihood
    t_c = segment_logprobs[c, b]                      [C]   the teacher's (the sum of its realised log-probs in c)
Binarised f-divergence at temperature tau (the paper's; tokenkit's ``binary_ce`` is its forward KL up to a
teacher-only constant): each segment is a Bernoulli event "the segment's bytes come next",
    P_c = (p, 1 - p),  p = exp(min(t_c / tau, -eps));    Q_c = (q, 1 - q),  q = exp(min(s_c / tau, -eps))
    D_c = divergence(P_c, Q_c) on the two buckets (``divergence.py``: forward_kl = p log(p/q) + (1-p) log((1-p)/(1-q)),
          reverse_kl, jsd), eps = 1e-6 keeps log(1 - q) finite;   U = the tokens of the used segments
Each token's alpha-mix, as in the same-tokenizer loss, over the teacher signals that cover it: its coverage
kappa_t = (1 - gamma) [t in U] + gamma [t in P] in [0, 1] goes to them, the rest to its own CE (a token no teacher
signal covers keeps plain CE):
    loss_sum = alpha (1 - gamma) sum_c n_c D_c + alpha gamma sum_t w_t f_t + sum_t w_t (1 - alpha kappa_t) (-l_t)
    (w = loss_mask; CE at tau = 1)                 num_tokens = #{t : w_t != 0}
gamma = 0 is ALM alone, gamma = 1 the token-level term alone. Segment terms count only tokens with w_t != 0 (a
segment with one masked token drops out whole). Gradient: with g_t = d loss_sum / d l_t (alpha (1 - gamma) n_c
dD_c/ds_c, minus (1 - alpha kappa_t) w_t) and h_t = d loss_sum / d f_t (alpha gamma w_t), d r_t = -g_t (softmax(r) -
onehot(y_t)) + h_t df_t/dr: the chunk loop's CE and KD coefficients (``token_math``) kept apart in one pass
(``fused_head.fused_token_values``) and scaled per token. The segment math is O(T) autograd on the all-reduced l and
f (identical on every TP rank); the vocab work is the fused head in its ``recompute`` mode (g_t is known only in
backward): one pass over the logits forms both terms.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .loss_plan import IGNORE_INDEX, LossPlan, prepare_batch, use_triton_kernels
from .divergence import bucket_divergence
from .fused_head import fused_token_values
from .options import KDLossOptions, KDLossResult
from .topk_teacher import TopKTeacher
from .tp import hidden_to_tp_region, resolve_shard
from .validate import check_shapes, check_values

EPS = 1e-6


class CrossTokenizerTeacher(NamedTuple):
    """A teacher cached with another tokenizer, aligned to the student's tokens (``cache.cross_tokenizer.align``): per
    student position its ALM segment and where its token-level candidates are, per segment the teacher's log-likelihood,
    the sample's candidates per cached position (the top-K in the student's first tokens, and the realised token) and
    the candidates of the positions inside a teacher token. Shapes batch-first as a dataset yields them ([b, S_s]
    student positions, [b, S, K] cached positions); the loss takes them in [s, b] order (``tensor_map`` of a transpose).
    K = J = 0 where the store holds no top-K (a sampled store)."""

    segment_ids: torch.Tensor        # [b, S_s] int64: the segment of each label within its sample, -1: none
    segment_logprobs: torch.Tensor   # [b, S_s] float: entry c = t_c of the sample's segment c (rows beyond unused)
    token_positions: torch.Tensor    # [b, S_s] int64: the cached position u a boundary position reads, -1 elsewhere
    token_ids: torch.Tensor          # [b, S, K] int32: the top-K's students' first tokens mu (-1: none)
    token_logprobs: torch.Tensor     # [b, S, K] float: the top-K's log-probs
    realised_logprobs: torch.Tensor  # [b, S] float: the realised token's log-prob (candidate K unless in the top-K)
    realised_slots: torch.Tensor     # [b, S] int64: the realised token's slot, K: not in the top-K (its mu: the label)
    mid_ids: torch.Tensor            # [b, S_s, J] int32: inside a teacher token, the position's candidates' mu (-1)
    mid_logprobs: torch.Tensor       # [b, S_s, J] float: their log p_v - log Z_t, -inf: none


def token_teacher(teacher: CrossTokenizerTeacher, labels: torch.Tensor) -> TopKTeacher:
    """The token-level term's teacher at each student position (module docstring; [s, b] order): the K + 1
    candidates of the cached position a boundary position reads, the realised one's id the position's label
    (``labels`` [S_s, b]), or a position's own candidates inside a teacher token -> ids and log-probs [S_s, b, K + 1]
    in the student's ids, -inf (and id 0) where none."""
    positions = teacher.token_positions                                                      # [S_s, b]
    k = teacher.token_ids.shape[-1]
    index = positions.clamp(min=0)
    dtype = torch.promote_types(torch.promote_types(teacher.token_logprobs.dtype, teacher.realised_logprobs.dtype),
                                teacher.mid_logprobs.dtype)
    realised = teacher.realised_slots.gather(0, index)[..., None]                            # [S_s, b, 1]
    outside = teacher.realised_logprobs.gather(0, index)[..., None].to(dtype)                # candidate K
    ids = teacher.token_ids.gather(0, index[..., None].expand(-1, -1, k)).long()              # [S_s, b, K]
    ids = torch.cat([ids, torch.zeros_like(ids[..., :1])], -1).scatter(-1, realised, labels.long().clamp(min=-1)[
        ..., None])                                                                           # IGNORE_INDEX: none
    logprobs = teacher.token_logprobs.gather(0, index[..., None].expand(-1, -1, k)).to(dtype)
    logprobs = torch.cat([logprobs, torch.where(realised == k, outside, -torch.inf)], -1)     # [S_s, b, K + 1]
    pad = k + 1 - teacher.mid_ids.shape[-1]
    mid_ids = torch.nn.functional.pad(teacher.mid_ids.long(), (0, pad), value=-1)
    mid_logprobs = torch.nn.functional.pad(teacher.mid_logprobs.to(dtype), (0, pad), value=-torch.inf)
    boundary = (positions >= 0)[..., None]
    ids, logprobs = torch.where(boundary, ids, mid_ids), torch.where(boundary, logprobs, mid_logprobs)
    valid = (ids >= 0) & (logprobs > -torch.inf)
    return TopKTeacher(torch.where(valid, ids, 0), torch.where(valid, logprobs, -torch.inf))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-x.exp()), torch.log(-torch.expm1(x)))


def binarised_divergence(teacher: torch.Tensor, student: torch.Tensor, *, divergence: str, jsd_beta: float,
                         temperature: float) -> torch.Tensor:
    """D_c [C] of segment log-likelihoods t_c, s_c [C] (module docstring)."""
    log_p = (teacher / temperature).clamp(max=-EPS)
    log_q = (student / temperature).clamp(max=-EPS)
    buckets_p = torch.stack([log_p, _log1mexp(log_p)], -1)                   # [C, 2]
    buckets_q = torch.stack([log_q, _log1mexp(log_q)], -1)
    return bucket_divergence(buckets_p, buckets_q, torch.ones_like(buckets_p, dtype=torch.bool), divergence, jsd_beta)


FIXED_OPTIONS = ("tail", "impl", "mode")
"""The ``KDLossOptions`` this loss does not take: its token-level term has the ghost tail (the teacher's candidates
that reach no student token), and its one pass is the fused head in ``recompute`` mode (g_t is known only in
backward)."""


def check_options(options: KDLossOptions) -> None:
    """ValueError, in one line naming the setting, for an option of :data:`FIXED_OPTIONS` away from its default:
    this loss would ignore it."""
    default = KDLossOptions()
    for name in FIXED_OPTIONS:
        if getattr(options, name) != getattr(default, name):
            raise ValueError(f"kd.{name}={getattr(options, name)!r} has no effect on a student with its own tokenizer "
                             f"(the cross-tokenizer loss: a ghost-tail token term, one fused pass in recompute mode); "
                             f"remove it (the default is {getattr(default, name)!r})")


def cross_tokenizer_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher: CrossTokenizerTeacher, *,
                         labels: torch.Tensor, loss_mask: torch.Tensor | None = None,
                         options: KDLossOptions | None = None, tp_group=None, sequence_parallel: bool = False,
                         accumulate_main_grad: bool = True, **option_overrides) -> KDLossResult:
    """The ALM segment loss, and with ``token_weight`` > 0 the token-level term, (module docstring) of a student
    lm_head against a cross-tokenizer teacher.

    Shapes: hidden [s, b, H] ([s/tp, b, H] with sequence_parallel), weight [V/tp, H] (this rank's vocab shard),
    labels int [s, b] (global ids, IGNORE_INDEX = -100: none), teacher in [s, b] order (``CrossTokenizerTeacher``:
    segment_ids, segment_logprobs, token_positions [s, b], token_ids, token_logprobs [S, b, K], realised_logprobs,
    realised_slots [S, b], mid_ids, mid_logprobs [s, b, J]), loss_mask [s, b] (default 1). Every TP rank returns the
    same sums; hidden's gradient is all-reduced (reduce-scattered with sequence_parallel) by megatron-core's mappings,
    dW goes to the weight's fp32 ``main_grad`` when it has one (``accumulate_main_grad``). Of ``options`` (with
    ``option_overrides``) it reads ``divergence``, ``jsd_beta``, ``temperature`` (the binarisation's), ``alpha``,
    ``token_weight``, ``chunk_bytes``, ``kernels``, ``validate``, ``mass_tolerance`` (the others are refused,
    :func:`check_options`): divergence on the two-bucket segment events and on the token-level
    buckets, which are not tempered; the vocab work of the one pass runs on the Triton kernels where ``kernels``
    resolves to them (``auto``: CUDA, or the CPU interpreter; not float64).

    Reported figures (``KDLossResult.report``): ``segment loss`` (sum_c n_c D_c per token), ``lm loss`` (per token),
    ``segments`` (used segments per token), ``segment gap`` (mean |t_c - s_c| in nats per segment), and with the
    token-level term ``token kd loss`` (per covered token) and ``covered`` (per token).
    """
    options = (options or KDLossOptions()).with_overrides(**option_overrides)
    check_options(options)
    token_weight = options.token_weight
    with_tokens = token_weight > 0.0
    if with_tokens and teacher.token_ids.shape[-1] == 0:
        raise ValueError(f"token_weight={token_weight} needs the teacher's top-K, and these rows carry none (a store "
                         "without a top-K); use token_weight=0")
    token_options = KDLossOptions(tail="ghost", divergence=options.divergence, jsd_beta=options.jsd_beta, alpha=1.0,
                                 chunk_bytes=options.chunk_bytes, kernels=options.kernels, validate=options.validate,
                                 mass_tolerance=options.mass_tolerance)
    shard = resolve_shard(tp_group, weight.shape[0])
    seq = hidden.shape[0] * (shard.size if sequence_parallel else 1)
    tokens = (seq, hidden.shape[1])
    for name, value in (("labels", labels), ("segment_ids", teacher.segment_ids),
                        ("segment_logprobs", teacher.segment_logprobs), ("token_positions", teacher.token_positions),
                        ("loss_mask", loss_mask)):
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
        targets = token_teacher(teacher, labels)                              # [s, b, K + 1]
        check_shapes(hidden, weight, targets, loss_mask, labels, token_options, shard, sequence_parallel)
        if options.validate:
            check_values(targets, loss_mask, labels, token_options, shard.vocab_size)
        k = targets.ids.shape[-1]
        slots = TopKTeacher(targets.ids.reshape(-1, k),
                            torch.where(counted[:, None], targets.logprobs.reshape(-1, k), -torch.inf))
    else:                                                                 # no teacher slots: l only
        ids = torch.zeros(counted.shape[0], 0, dtype=torch.int32, device=hidden.device)
        slots = TopKTeacher(ids, ids.to(torch.float32))
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    triton = use_triton_kernels(options.kernels, hidden)
    plan = LossPlan(options=token_options, shard=shard, dtype=dtype, with_labels=True, triton=triton,
                    logits_dtype=torch.promote_types(hidden.dtype, weight.dtype) if triton else None,
                    accumulate_main_grad=accumulate_main_grad, grad_enabled=torch.is_grad_enabled())
    batch = prepare_batch(plan, slots, torch.ones_like(counted, dtype=dtype), flat_labels)
    hidden2d = hidden_to_tp_region(hidden, shard, sequence_parallel).reshape(-1, hidden.shape[-1])   # [T, H]
    logprobs, token_kd = fused_token_values(hidden2d, weight, plan, batch)                 # [T] l, [T] f
    weights = loss_mask.reshape(-1).to(dtype)
    ce_sum = -(weights * logprobs).sum()
    token_sum = (weights * token_kd).sum()
    # segment sums: sample b's segment c -> flat index c * b_size + b ([s, b] order, like the tokens)
    batch_size = tokens[1]
    samples = torch.arange(batch_size, device=hidden.device).repeat(tokens[0])
    flat_ids = teacher.segment_ids.reshape(-1).long()
    in_segment = flat_ids >= 0
    target = torch.where(in_segment, flat_ids * batch_size + samples, 0)
    num_slots = tokens[0] * batch_size
    student = torch.zeros(num_slots, dtype=dtype, device=hidden.device).index_add(
        0, target, torch.where(in_segment, logprobs, 0.0))
    sizes = torch.zeros(num_slots, dtype=dtype, device=hidden.device).index_add(0, target, in_segment.to(dtype))
    dropped = torch.zeros(num_slots, dtype=dtype, device=hidden.device).index_add(
        0, target, (in_segment & ~counted).to(dtype))
    used = (sizes > 0) & (dropped == 0)                                                      # [s * b] segment slots
    teacher_ll = teacher.segment_logprobs.reshape(-1).to(dtype)
    d = binarised_divergence(torch.where(used, teacher_ll, -1.0), torch.where(used, student, -1.0),
                             divergence=options.divergence, jsd_beta=options.jsd_beta,
                             temperature=options.temperature)
    segment_sum = torch.where(used, sizes * d, 0.0).sum()
    covered = counted & batch.teacher.valid.any(-1)                                         # [T] t in P
    coverage = (1.0 - token_weight) * (in_segment & used[target]).to(dtype) + token_weight * covered.to(dtype)
    loss_sum = options.alpha * ((1.0 - token_weight) * segment_sum + token_weight * token_sum) - \
        (weights * (1.0 - options.alpha * coverage) * logprobs).sum()
    num_tokens = torch.count_nonzero(counted).to(torch.int64)
    count, num_segments = num_tokens.to(dtype), used.sum().to(dtype)
    gap = torch.where(used, (teacher_ll - student).abs(), 0.0).sum()
    report = {"segment loss": torch.stack([segment_sum, count]), "lm loss": torch.stack([ce_sum, count]),
              "segments": torch.stack([num_segments, count]), "segment gap": torch.stack([gap, num_segments])}
    if with_tokens:
        num_covered = covered.sum().to(dtype)
        report["token kd loss"] = torch.stack([token_sum, num_covered])
        report["covered"] = torch.stack([num_covered, count])
    return KDLossResult(loss_sum, num_tokens, {name: pair.detach() for name, pair in report.items()})
