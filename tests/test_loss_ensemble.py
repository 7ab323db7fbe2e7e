"""Issue #30 at the loss: the ensemble of teachers (``cache.rows.ensemble_rows.mixture_teacher``) against its float64
definition on the full vocabulary, and the per-source report groups against the loss of each group's tokens alone."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kd_plugin.cache.rows.ensemble_rows import mixture_teacher
from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss
from tests.test_loss_helpers import make_case, one_thread, rel_err  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

S, B, H, V = 3, 13, 17, 41


def _student(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) / H ** 0.5 * 2
    return hidden, weight


def _teachers(ks, seed: int = 1):
    """Full teacher distributions [S, B, V] (float64) and each one's top-K_j as a ``TopKTeacher`` (K_j = V: all)."""
    gen = torch.Generator().manual_seed(seed)
    full = [(torch.randn(S, B, V, generator=gen, dtype=torch.float64) * 2.5).log_softmax(-1) for _ in ks]
    tops = []
    for log_p, k in zip(full, ks):
        logprobs, ids = log_p.topk(k, dim=-1)
        tops.append(TopKTeacher(ids.to(torch.int32), logprobs))
    return full, tops


def _kd_sum(hidden, weight, teacher, **options):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    result = topk_kd_loss(hidden, weight, teacher, **options)
    result.loss_sum.backward()
    return result.loss_sum, hidden.grad, weight.grad


def _dense_kl(hidden, weight, log_p, buckets=None):
    """sum over tokens of KL(P || Q) in float64 autograd; P [S, B, V] on the full vocab, or, with ``buckets``
    (a bool [S, B, V] support), over the support's ids plus one tail bucket (the ghost definition)."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    log_q = (hidden @ weight.t()).log_softmax(-1)
    if buckets is None:
        p = log_p.exp()
        kl = torch.where(p > 0, p * (log_p - log_q), 0.0).sum()
    else:
        p = torch.where(buckets, log_p.exp(), 0.0)
        q = log_q.exp()
        kl = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
        tail_p, tail_q = 1 - p.sum(-1), torch.where(buckets, 0.0, q).sum(-1)
        kl = (kl + torch.where(tail_p > 0, tail_p * (tail_p.log() - tail_q.log()), 0.0)).sum()
    kl.backward()
    return kl, hidden.grad, weight.grad


@pytest.mark.parametrize("tail", ["ghost", "none", "renorm"])
def test_ensemble_of_whole_distributions_is_the_exact_mixture_kl(tail):
    """Teachers that hold their whole vocabulary (K_j = V): the ensemble teacher's loss is KL(sum_j pi_j p_j || q)
    on the full vocabulary, in float64, with its gradients (every tail: nothing is outside U)."""
    hidden, weight = _student()
    full, tops = _teachers((V, V))
    weights = (0.3, 1.1)                                               # normalised to 3/14, 11/14
    mixture = torch.logsumexp(torch.stack([lp + math.log(w / 1.4) for lp, w in zip(full, weights)]),
                              dim=0)
    ref = _dense_kl(hidden, weight, mixture)
    got = _kd_sum(hidden, weight, mixture_teacher(tops, weights), tail=tail)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-9, tail


def test_ensemble_of_top_k_teachers_is_its_definition_on_the_union():
    """K_1 = 6, K_2 = 9 of V = 41: the ghost loss of the ensemble teacher equals the float64 definition written
    directly on the dense grid: P(v) = sum_j pi_j p_j(v) [v in I_j] on U = I_1 u I_2, one tail bucket holding
    sum_j pi_j (1 - m_j) against the student's mass outside U; renorm equals KL(P/P(U) || q/q(U)) on U. Gradients
    too. A top-p-like padding slot (-inf) and the two stores' rows padded to different K change nothing."""
    hidden, weight = _student(2)
    full, tops = _teachers((6, 9), seed=3)
    tops[0] = TopKTeacher(*[torch.cat([t, t[..., :1]], -1) for t in tops[0]])      # one more slot: padding (-inf)
    tops[0].logprobs[..., -1] = -torch.inf                                           # on an id the row holds
    weights = (0.6, 0.4)
    grids = []
    for top, w in zip(tops, weights):
        p = torch.zeros(S, B, V, dtype=torch.float64).scatter_add_(-1, top.ids.long(),
                                                                  torch.where(top.logprobs > -torch.inf,
                                                                              top.logprobs.exp(), 0.0))
        grids.append(w * p)
    p_union = sum(grids)                                                # [S, B, V] P(v), 0 off U
    union = p_union > 0
    outside = sum(w * (1 - torch.where(t.logprobs > -torch.inf, t.logprobs.exp(), 0.0).sum(-1))
                  for t, w in zip(tops, weights))
    torch.testing.assert_close(1 - p_union.sum(-1), outside, rtol=0, atol=1e-12)   # the tail is each one's, weighted
    teacher = mixture_teacher([tops[0], tops[1].padded(12)], weights)   # a blend pads rows of smaller K
    ref = _dense_kl(hidden, weight, torch.where(union, p_union.log(), -torch.inf), buckets=union)
    for a, b in zip(_kd_sum(hidden, weight, teacher, tail="ghost"), ref):
        assert rel_err(a, b) < 1e-9
    # renorm: both renormalised over U
    hidden_r, weight_r = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_q = (hidden_r @ weight_r.t()).log_softmax(-1)
    log_q_u = torch.where(union, log_q, -torch.inf).log_softmax(-1)
    log_p_u = torch.where(union, p_union.log(), -torch.inf).log_softmax(-1)
    renorm = torch.where(union, log_p_u.exp() * (log_p_u - log_q_u), 0.0).sum()
    renorm.backward()
    for a, b in zip(_kd_sum(hidden, weight, teacher, tail="renorm"), (renorm, hidden_r.grad, weight_r.grad)):
        assert rel_err(a, b) < 1e-9


def test_report_groups_equal_the_loss_of_each_groups_tokens_alone():
    """``kd loss [g]`` / ``lm loss [g]`` of every formulation: the same figures as a second call whose loss_mask
    keeps only group g's tokens (float64; an empty group is [0, 0]; the groups' sums add up to the whole)."""
    case = make_case()
    s, b = case["loss_mask"].shape
    groups = torch.randint(0, 2, (s, b), generator=torch.Generator().manual_seed(4))     # group 2: no token
    names = ("code", "prose", "none")
    teacher = TopKTeacher(case["teacher_ids"], case["teacher_logprobs"])
    variants = [dict(impl="fused", mode="recompute", chunk_bytes=10 * 123 * 8),
                dict(impl="fused", mode="grad_in_forward"), dict(impl="forward_chunked"), dict(impl="dense")]
    for variant, (alpha, labels) in [(v, a) for v in variants for a in ((0.4, case["labels"]), (1.0, None))] + [
            (dict(impl="fused", tail="renorm"), (1.0, None))]:
        common = dict(labels=labels, alpha=alpha, temperature=1.5, **variant)
        whole = topk_kd_loss(case["hidden"], case["weight"], teacher, loss_mask=case["loss_mask"], groups=groups,
                             group_names=names, **common)
        for index, name in enumerate(names):
            alone = topk_kd_loss(case["hidden"], case["weight"], teacher,
                                 loss_mask=case["loss_mask"] * (groups == index), **common)
            for figure in ("kd loss", "lm loss") if labels is not None else ("kd loss",):
                got, ref = whole.report[f"{figure} [{name}]"], alone.report[figure]
                assert rel_err(got, ref) < 1e-12 if index < 2 else torch.equal(got, torch.zeros(2, dtype=got.dtype)), \
                    (variant, name, figure, got, ref)
        assert rel_err(sum(whole.report[f"kd loss [{n}]"] for n in names), whole.report["kd loss"]) < 1e-12
    with pytest.raises(ValueError, match=r"groups must lie in \[0, 2\)"):
        topk_kd_loss(case["hidden"], case["weight"], teacher, groups=groups + 1, group_names=names[:2])
    with pytest.raises(ValueError, match="groups without group_names"):
        topk_kd_loss(case["hidden"], case["weight"], teacher, groups=groups)
