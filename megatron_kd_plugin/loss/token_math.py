"""Per-token loss and logit-gradient coefficients from a few all-reduced per-token numbers. The math, once.

Shapes: T tokens (a chunk of c of them here), K teacher slots, V vocab (all ranks, padded rows included),
V/tp this rank's shard. r = X W^T are the raw logits [T, V], z = r / tau, q = softmax(z) over the full vocab.

Teacher (``teacher.py``): slot k of a token holds id I_k and log-prob l_k; repeated ids are merged, -inf slots are
padding. The support S = the valid ids, m = sum_k exp(l_k). Buckets and their tempered teacher probabilities:
    ghost   K + 1 buckets: the K ids and the tail (ids outside S).  P = softmax([l / tau, log T])
            (the tail bucket is absent when S covers the whole vocab, K = V), where T stands for the teacher's
            tempered tail sum_{j not in S} p_j^(1/tau), which the cache does not hold: only its mass 1 - m is known.
            T = (1 - m)^(1/tau) rho,  rho = sum_{j not in S} q1_j^(1/tau) / (sum_{j not in S} q1_j)^(1/tau)
            with q1 = softmax(r) the student at tau = 1 (stop-gradient): the teacher's tail given the student's
            tail shape. rho = 1 at tau = 1 (T = 1 - m, exact); for tau > 1, 1 <= rho <= (V - K)^(1 - 1/tau).
            It makes the loss consistent: if the student equals the teacher the estimate is exact and the loss 0,
            and the one student whose buckets give zero gradient has q1_{I_k} = p_k and tail mass 1 - m, as at
            tau = 1. (rho = 1 at every tau, "the tail tempered like one more token", is the smallest tempered tail
            1 - m could have for tau > 1: it drove the student to starve every id outside the teacher's top-K,
            and a demo heal at tau = 2 from perplexity 140 to 414.) In the chunk's numbers (below):
            log rho = log E_tail - log S1_tail / tau, S1_tail = sum_{j not in S} exp(r_j - tau M); rho = 1 where
            either sum underflows.
    none    K buckets, not normalised:                              P_k = m * softmax_K(l / tau)_k
    renorm  K buckets:                                              P = softmax_K(l / tau)
    sampled K buckets, the distinct drawn ids (tau = 1, forward KL):  P_b = sum_{k: I_k = b} w_k
            The slots hold N ids drawn iid from a proposal q'_v ∝ p_v^(1/t) (p the teacher over the full vocab,
            l_k = log p_{I_k}, not summed over repeats) with importance weights w_k = p_{I_k} / (N q'_{I_k}); so
            P is the unbiased estimate P^_v = (1/N) sum_n [i_n = v] p_v / q'_v of p (E[P^] = p; at t = 1 the
            empirical frequency). f = sum_k w_k (l_k - log Q_{I_k}) = KL(P || Q) + sum_k w_k l_k - sum_b P_b log P_b
            (the last two terms: ``TeacherBuckets.value_offset``, teacher-only), so E[f] = KL(p || q) over the full
            vocab exactly and df/dz = (sum_b P_b) q - P^ estimates the full-KL gradient q - p without bias.
            Slots with l = -inf or w = 0 are not drawn (no bucket). Its student side is ``none``'s.
Student, with L = logsumexp(z) over V and g_k = z_{I_k}:
    ghost   log Q_k = g_k - L,   log Q_tail = log sum_{j not in S} exp(z_j) - L   (computed directly, no 1 - s)
    none    log Q_k = g_k - L          (also ``sampled``)
    renorm  log Q_k = g_k - logsumexp_k(g)                            (no L: only the K rows W[I] are needed)
KD per token f = divergence(P, Q) on the buckets (``divergence.py``; sampled: + its value offset),
a_b = df/dlog Q_b, A = sum_b a_b.
Gradient w.r.t. z, with q_j = exp(z_j - L) = E_j / Ssum where E_j = exp(z_j - M), M = max_j z_j,
Ssum = sum_j E_j, and E_tail = sum_{j not in S} E_j:
    ghost   dz_j = (a_tail / E_tail - A / Ssum) E_j  for j not in S;   dz_{I_k} = a_k - A q_{I_k}
    none    dz_j = (-A / Ssum) E_j                   for j not in S;   dz_{I_k} = a_k - A q_{I_k}   (also sampled)
    renorm  dz_j = 0                                 for j not in S;   dz_{I_k} = a_k - A Q_k
So a logits chunk's gradient is one per-token coefficient times E off the support plus K scattered values.
Loss and gradient w.r.t. r, with w the token's loss_mask weight and CE at tau = 1 (L1 = logsumexp(r)):
    loss = w (alpha tau^2 f + (1 - alpha) (L1 - r_y))
    dr   = w (alpha tau dz + (1 - alpha) (softmax(r) - onehot(y)))
A label y = -100 (``plan.IGNORE_INDEX``, torch's and Hugging Face's ignore_index) has no CE term: that token's loss
is w alpha tau^2 f (its KD term counts, and it counts in num_tokens while w != 0), whether or not inputs are
validated. Any other label must lie in [0, V) on tokens with w != 0 (checked when ``validate``).
At tau = 1 softmax(r) = q, so the CE part folds into the same coefficients; otherwise it needs E1 = exp(r - tau M)
and its sum S1 (one more exp pass over the chunk); the ghost tail at tau != 1 needs S1_tail, E1's sum off the
support (the same pass; T is a constant of the gradient, so nothing else changes). Under TP every rank holds its
shard of E: only M (MAX), and E_tail, g_k, r_y, S1 and S1_tail (SUM, each entry owned by one rank) are all-reduced;
every rank then has every per-token number, and its own E-chunk gives its own dr-chunk.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .divergence import bucket_divergence, bucket_divergence_grad
from .options import KDLossOptions
from .teacher import TeacherBuckets


class TokenPartials(NamedTuple):
    """All-reduced per-token numbers of a chunk. Fields the path does not form are None."""

    support_logits: torch.Tensor         # [c, K] g_k = z_{I_k} (0 at invalid slots)
    row_max: torch.Tensor | None = None  # [c] M = max_j z_j
    tail_sum: torch.Tensor | None = None  # [c] E_tail = sum_{j not in S} exp(z_j - M)
    label_logit: torch.Tensor | None = None  # [c] r_y (tau = 1)
    ce_sum_exp: torch.Tensor | None = None  # [c] S1 = sum_j exp(r_j - tau M); None when tau = 1
    unit_tail_sum: torch.Tensor | None = None  # [c] S1_tail = sum_{j not in S} exp(r_j - tau M): ghost, tau != 1


REDUCED_FIELDS = ("tail_sum", "support_logits", "label_logit", "ce_sum_exp", "unit_tail_sum")
"""The :class:`TokenPartials` fields a chunk's one SUM all-reduce carries, in their column order (``row_max`` is the
MAX all-reduce's)."""


@dataclasses.dataclass(frozen=True)
class ReducedColumns:
    """The declared layout of a chunk's SUM all-reduce buffer [c, width]: the :data:`REDUCED_FIELDS` a call forms
    (``fields``), side by side in that order, ``support_logits`` K columns wide and every other one column. Each chunk
    backend packs its per-rank partial sums with :meth:`pack`; the chunk loop reads the reduced buffer back with
    :meth:`unpack`, so no column is found by its position anywhere else."""

    fields: tuple[str, ...]
    k: int

    def __post_init__(self):
        if [name for name in REDUCED_FIELDS if name in self.fields] != list(self.fields) or \
                not {"tail_sum", "support_logits"} <= set(self.fields):
            raise ValueError(f"reduced columns {self.fields}: expected tail_sum, support_logits and any of the rest of "
                             f"{REDUCED_FIELDS}, in that order")

    def _widths(self) -> list[int]:
        return [self.k if name == "support_logits" else 1 for name in self.fields]

    @property
    def width(self) -> int:
        return sum(self._widths())

    def pack(self, **columns: torch.Tensor) -> torch.Tensor:
        """[c, width] from each field's per-rank values ([c, K] ``support_logits``, [c] the others)."""
        if set(columns) != set(self.fields):
            raise ValueError(f"a chunk backend formed {sorted(columns)}; the layout is {self.fields}")
        return torch.cat([columns[name].reshape(len(columns[name]), -1) for name in self.fields], -1)

    def unpack(self, packed: torch.Tensor, row_max: torch.Tensor) -> TokenPartials:
        """The chunk's :class:`TokenPartials` from its reduced buffer [c, width] and its row max M [c]."""
        parts = packed.split(self._widths(), -1)
        return TokenPartials(row_max=row_max, **{name: part if name == "support_logits" else part[:, 0]
                                                 for name, part in zip(self.fields, parts, strict=True)})


class TokenTerms(NamedTuple):
    """Per-token values (unweighted) and d loss_sum / d r coefficients (weighted) of a chunk."""

    kd: torch.Tensor             # [c] f (0 where the weight is 0)
    ce: torch.Tensor             # [c] L1 - r_y (0 without labels, where the weight is 0 or the label is ignored)
    student_mass: torch.Tensor   # [c] s = sum_k q_{I_k} (NaN without the full-vocab normaliser)
    dense_coef: torch.Tensor     # [c] coefficient of E off the support
    support_grad: torch.Tensor   # [c, K] added at the support ids (0 at invalid slots)
    label_grad: torch.Tensor     # [c] added at the label id
    ce_dense_coef: torch.Tensor | None  # [c] coefficient of E1 over the whole vocab (tau != 1 with labels)


def _tempered_ghost_buckets(log_p: torch.Tensor, partials: TokenPartials, tau: float) -> torch.Tensor:
    """[c, K + 1] teacher values [l / tau, log(1 - m) / tau] -> the normalised buckets log P with T = (1 - m)^(1/tau)
    rho (module docstring)."""
    spread = partials.tail_sum > 0
    spread = spread & (partials.unit_tail_sum > 0)
    log_rho = torch.where(spread, partials.tail_sum.log() - partials.unit_tail_sum.log() / tau, 0.0)
    log_p = torch.cat([log_p[:, :-1], (log_p[:, -1] + log_rho)[:, None]], -1)
    norm = log_p.logsumexp(-1, keepdim=True)                              # finite: a token has a bucket
    return log_p - torch.where(norm > -torch.inf, norm, 0.0)


def token_terms(partials: TokenPartials, teacher: TeacherBuckets, weight: torch.Tensor, options: KDLossOptions,
                has_label: torch.Tensor | None = None) -> TokenTerms:
    """Loss values and gradient coefficients of a chunk of c tokens; ``weight`` [c] is the loss_mask, ``has_label``
    [c] bool: the label is not IGNORE_INDEX (given iff ``partials.label_logit`` is)."""
    tau, alpha = options.temperature, options.alpha
    g, valid = partials.support_logits, teacher.valid                        # [c, K]
    zero = g.new_zeros(())
    counts = weight != 0
    full_vocab = partials.row_max is not None
    if full_vocab:
        support_exp = torch.where(valid, (g - partials.row_max[:, None]).exp(), zero)   # E at the support
        sum_exp = partials.tail_sum + support_exp.sum(-1)                    # [c] Ssum
        q_support = support_exp / sum_exp[:, None]                           # [c, K] q_{I_k}
        student_mass = q_support.sum(-1)
    else:
        student_mass = torch.full_like(weight, torch.nan)

    log_p, present = teacher.log_p, valid
    if options.tail == "renorm":
        log_q = torch.where(valid, g, -torch.inf)
        log_q = torch.where(valid.any(-1, keepdim=True), log_q, zero).log_softmax(-1)   # [c, K] log Q_k
        counts = counts & valid.any(-1)
    else:
        log_q = g - (partials.row_max + sum_exp.log())[:, None]              # g_k - L
        if options.tail == "ghost":
            log_q_tail = partials.tail_sum.log() - sum_exp.log()
            log_p = torch.cat([log_p, teacher.log_p_tail[:, None]], -1)       # [c, K + 1]
            if partials.unit_tail_sum is not None:
                log_p = _tempered_ghost_buckets(log_p, partials, tau)
            log_q = torch.cat([log_q, log_q_tail[:, None]], -1)
            present = torch.cat([present, teacher.tail_present[:, None]], -1)
    f = bucket_divergence(log_p, log_q, present, options.divergence, options.jsd_beta) + teacher.value_offset
    a = bucket_divergence_grad(log_p, log_q, present, options.divergence, options.jsd_beta)
    a_total = a.sum(-1)                                                      # [c] A
    k = valid.shape[-1]
    if options.tail == "renorm":
        dense = torch.zeros_like(weight)
        support = a - a_total[:, None] * log_q.exp()
    else:
        dense = -a_total / sum_exp
        support = a[:, :k] - a_total[:, None] * q_support
        if options.tail == "ghost":
            has_tail = teacher.tail_present & (partials.tail_sum > 0)
            dense = dense + torch.where(has_tail, a[:, k] / partials.tail_sum, zero)
    kd_scale = torch.where(counts, weight * (alpha * tau), zero)              # d(alpha tau^2 f)/dz * dz/dr
    dense_coef = torch.where(counts, kd_scale * dense, zero)
    support_grad = torch.where(counts[:, None] & valid, kd_scale[:, None] * support, zero)
    kd = torch.where(counts, f, zero)

    label_grad, ce, ce_dense_coef = torch.zeros_like(weight), torch.zeros_like(weight), None
    if partials.label_logit is not None:
        ce_counts = (weight != 0) & has_label
        ce_weight = torch.where(ce_counts, weight * (1.0 - alpha), zero)
        label_grad = -ce_weight
        if partials.ce_sum_exp is None:                                      # tau = 1: softmax(r) = q
            ce = partials.row_max + sum_exp.log() - partials.label_logit
            dense_coef = dense_coef + ce_weight / sum_exp
            support_grad = support_grad + torch.where(valid, ce_weight[:, None] * q_support, zero)
        else:
            ce = tau * partials.row_max + partials.ce_sum_exp.log() - partials.label_logit
            ce_dense_coef = ce_weight / partials.ce_sum_exp
        ce = torch.where(ce_counts, ce, zero)
    return TokenTerms(kd, ce, student_mass, dense_coef, support_grad, label_grad, ce_dense_coef)
