"""The kernel checks (collected through tests/test_kernels.py): the per-chunk kernels against a float64 truth,
Triton (compiled on CUDA, else by the CPU interpreter) and the PyTorch reference, on odd shapes; and the end-to-end
identity dX = sum_r G_r W_r against autograd for the loss options the fused loss builds from them.

On CPU this module must run in a process that had TRITON_INTERPRET=1 before triton was first imported (the
interpreter cannot call triton.language's own jitted helpers, e.g. tl.max, once they were built uninterpreted).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kd_plugin.kernels import chunk_logit_grad_, chunk_row_stats, reference, use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (c, Vp, J, logit magnitude): odd sizes crossing the interpreter's 32-column tiles, 48-column splits and 32-id
# blocks; J = 0, J = Vp and J > Vp (duplicates); large logits for the online max.
SHAPES = [(3, 123, 1, 3.0), (37, 123, 7, 3.0), (7, 123, 123, 3.0), (5, 257, 40, 30.0), (4, 64, 150, 3.0), (2, 200, 0, 3.0)]
DTYPES = [torch.float32, torch.bfloat16]


def _case(c, Vp, J, magnitude, dtype, seed=0):
    """logits [c, Vp], ids [c, J] with duplicates and -1s, per-token and per-id coefficients (row 0 masked)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(c, Vp, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    ids = torch.randint(-1, Vp, (c, J), generator=g)
    if J >= 3:
        ids[:, 1] = ids[:, 0]  # duplicates
        ids[:, 2] = -1  # absent on this shard
    dense_coef = torch.randn(c, generator=g, dtype=torch.float64)
    sparse_coef = torch.randn(c, J, generator=g, dtype=torch.float64)
    dense_coef[0], sparse_coef[0] = 0.0, 0.0  # a masked token
    return logits.to(DEVICE), ids.to(DEVICE), dense_coef.to(DEVICE), sparse_coef.to(DEVICE)


def _truth_stats(logits, ids, scale, exclude=None):
    u = logits.double() * scale  # [c, Vp]
    row_max = u.amax(-1)
    gathered = torch.where(ids >= 0, u.gather(1, ids.clamp(min=0)), 0.0)
    e = (u - row_max[:, None]).exp()
    if exclude is not None:
        for t, k in (exclude >= 0).nonzero().tolist():
            e[t, exclude[t, k]] = 0.0
    return row_max, e.sum(-1), gathered


def _truth_grad(logits, lse, dense_coef, ids, sparse_coef, scale, ce_lse=None, ce_coef=None):
    x = logits.double()  # [c, Vp]
    grad = dense_coef[:, None] * (x * scale - lse[:, None]).exp()
    present = ids >= 0
    for k in range(ids.shape[1]):  # duplicates add
        rows = present[:, k].nonzero()[:, 0]
        grad[rows, ids[rows, k]] += sparse_coef[rows, k]
    grad = grad * scale
    if ce_coef is not None:
        grad = grad + ce_coef[:, None] * (x - ce_lse[:, None]).exp()
    return grad


def _condition(logits, scale):
    """1 + max|u|: fp32 math on u carries an absolute error ~ |u| eps."""
    return 1.0 + scale * logits.double().abs().max().item() if logits.numel() else 1.0


def _max_err(value, truth):
    return (value.double() - truth).abs().max().item() if truth.numel() else 0.0


def _assert_near_truth(fast, ref, truth, rel):
    """The reference within rel * max|truth| of the float64 truth, the fast path within twice the reference's error
    (plus the same floor)."""
    floor = rel * max(truth.abs().max().item() if truth.numel() else 0.0, 1.0)
    ref_err, fast_err = _max_err(ref, truth), _max_err(fast, truth)
    assert ref_err <= floor, (ref_err, floor)
    assert fast_err <= 2 * ref_err + floor, (fast_err, ref_err, floor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_row_stats_match_float64_truth(shape, dtype):
    c, Vp, J, magnitude = shape
    logits, ids, _, _ = _case(c, Vp, J, magnitude, dtype)
    scale = 1 / 1.7
    exclude = ids.flip(-1)[:, : max(J - 2, 0)]  # unsorted, with duplicates and -1s
    near_end = (Vp - 1 - torch.arange(c, device=DEVICE)).clamp(min=-1)[:, None]  # one id per row, in the last tile
    rel = 2.0**-22 * _condition(logits, scale)
    for exclude_arg in (None, exclude, near_end):
        fast = chunk_row_stats(logits, ids, scale, exclude=exclude_arg, kernels="triton")
        ref = chunk_row_stats(logits, ids, scale, exclude=exclude_arg, kernels="torch")
        truth = _truth_stats(logits, ids, scale, exclude_arg)
        for name, f, r, t in zip(("row_max", "row_sumexp", "gathered"), fast, ref, truth):
            assert f.dtype == torch.float32 and f.shape == t.shape, name
            _assert_near_truth(f, r, t, rel=rel)
        for name, f, r in zip(("row_max", "row_sumexp", "gathered"), fast, ref):  # Triton and PyTorch agree
            torch.testing.assert_close(f, r, rtol=rel, atol=rel, msg=name)


@pytest.mark.parametrize("with_ce", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_logit_grad_matches_float64_truth(shape, dtype, with_ce):
    c, Vp, J, magnitude = shape
    logits, ids, dense_coef, sparse_coef = _case(c, Vp, J, magnitude, dtype, seed=1)
    scale = 1 / 1.7
    lse = torch.logsumexp(logits.double() * scale, -1) + 0.5  # a global LSE: this shard holds part of the mass
    ce = {}
    if with_ce:
        ce = dict(ce_lse=torch.logsumexp(logits.double(), -1) + 0.25,
                  ce_coef=-dense_coef.roll(1))
        ce["ce_coef"][0] = 0.0  # row 0 stays masked
    truth = _truth_grad(logits, lse, dense_coef, ids, sparse_coef, scale, **ce)
    args = (lse.float(), dense_coef.float(), ids, sparse_coef.float(), scale)
    ce32 = {name: value.float() for name, value in ce.items()}
    fast, ref = logits.clone(), logits.clone()
    out = chunk_logit_grad_(fast, *args, **ce32, kernels="triton")
    chunk_logit_grad_(ref, *args, **ce32, kernels="torch")
    assert out is fast and out.dtype == dtype  # in place, in the logits' dtype
    assert (fast[0] == 0).all()  # the masked token
    # fp32 math (exp of u - lse: error ~ |u| eps) then one rounding to the output dtype (half an ulp)
    rel = 2.0**-22 * _condition(logits, scale) + (0.0 if dtype == torch.float32 else 2.0**-8)
    _assert_near_truth(fast, ref, truth, rel=rel)
    ulp_bound = rel * truth.abs() + 2.0**-22 * truth.abs().amax(-1, keepdim=True) + 1e-30
    assert ((fast.double() - truth).abs() <= 2 * ulp_bound).all()  # element-wise, not just the max


def test_dispatch(monkeypatch):
    logits = torch.zeros(2, 5)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton(logits, "auto") and not use_triton(logits, "torch")
    with pytest.raises(ValueError, match="kernels='triton' cannot run on cpu"):
        chunk_row_stats(logits, ids, 1.0, kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(logits, "auto") and not use_triton(logits, "torch")
    with pytest.raises(ValueError, match="kernels='cuda'"):
        use_triton(logits, "cuda")
    with pytest.raises(ValueError, match="ids: expected"):
        chunk_row_stats(logits, ids[:1], 1.0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        chunk_row_stats(logits.t(), ids, 1.0)
    with pytest.raises(ValueError, match="sparse_coef: expected shape"):
        chunk_logit_grad_(logits, torch.zeros(2), torch.zeros(2), ids, torch.zeros(2, 2), 1.0)
    with pytest.raises(ValueError, match="ce_lse and ce_coef"):
        chunk_logit_grad_(logits, torch.zeros(2), torch.zeros(2), ids, torch.zeros(2, 1), 1.0, ce_coef=torch.zeros(2))


# ---- end to end: the loss options' logit gradients in the kernels' form, against autograd (docs/how-it-works/kernels.md) ----

def _bucket_divergence(log_p, log_q, divergence, beta=0.3):
    """Per-token divergence [c] between bucket distributions [c, B] (float64; no zero probabilities here)."""
    p, q = log_p.exp(), log_q.exp()
    if divergence == "forward_kl":
        return (p * (log_p - log_q)).sum(-1)
    if divergence == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _student_buckets(log_q_ids, log_q_tail, tail):
    """Student log-masses of the buckets [c, K(+1)]: log q at the teacher ids [c, K] (and the tail's [c])."""
    return log_q_ids if tail == "none" else torch.cat([log_q_ids, log_q_tail[:, None]], -1)


def _teacher_buckets(teacher_logprobs, tail, tau):
    """Teacher log-masses of the buckets at temperature tau (DESIGN.md §1)."""
    if tail == "none":  # the tempered top-K shape keeps the teacher's mass m
        log_m = torch.logsumexp(teacher_logprobs, -1, keepdim=True)
        return torch.log_softmax(teacher_logprobs / tau, -1) + log_m
    log_tail = torch.log1p(-teacher_logprobs.exp().sum(-1, keepdim=True))
    return torch.log_softmax(torch.cat([teacher_logprobs, log_tail], -1) / tau, -1)


def _kd_loss(hidden, weight, teacher_ids, teacher_logprobs, labels, mask, tail, divergence, tau, alpha):
    """sum_t mask_t (alpha tau^2 KD_t + (1 - alpha) CE_t), dense float64 (the autograd truth)."""
    log_q = torch.log_softmax(hidden @ weight.t() / tau, -1)  # [c, V]
    log_q_ids = log_q.gather(1, teacher_ids)
    kd = _bucket_divergence(_teacher_buckets(teacher_logprobs, tail, tau),
                            _student_buckets(log_q_ids, torch.log1p(-log_q_ids.exp().sum(-1)), tail), divergence)
    ce = -torch.log_softmax(hidden @ weight.t(), -1).gather(1, labels[:, None])[:, 0]
    return (mask * (alpha * tau**2 * kd + (1 - alpha) * ce)).sum()


def _kernel_grads(hidden, weight, teacher_ids, teacher_logprobs, labels, mask, tail, divergence, tau, alpha, tp,
                  dtype, kernels):
    """(dX, dW) from the kernels on tp vocab shards: stats, all-reduce by hand, per-token coefficients from the
    bucket gradient g = df/dlog Q (autograd on [c, K+1] only), then G_r and the two products."""
    c, V = hidden.shape[0], weight.shape[0]
    Vp = V // tp
    shards = [(hidden @ weight[r * Vp:(r + 1) * Vp].t()).to(dtype) for r in range(tp)]  # [c, Vp] each
    ids = torch.cat([teacher_ids, labels[:, None]], -1)  # [c, K + 1]: teacher ids, then the label
    local = [torch.where((ids >= r * Vp) & (ids < (r + 1) * Vp), ids - r * Vp, -1) for r in range(tp)]

    def global_stats(scale, exclude):
        """(M, SUM_r row_sumexp_r exp(row_max_r - M), gathered) after the all-reduces, float64."""
        stats = [chunk_row_stats(z, i, scale, exclude=e, kernels=kernels) for z, i, e in zip(shards, local, exclude)]
        row_max = torch.stack([s[0] for s in stats]).amax(0)  # all-reduce MAX
        sumexp = sum(s[1] * (s[0] - row_max).exp() for s in stats)  # all-reduce SUM
        return row_max.double(), sumexp.double(), sum(s[2] for s in stats).double()  # [c], [c], [c, K + 1]

    # the tail's sum E_tail directly (exclude = the teacher's ids), then the full sum and the LSE from it
    row_max, tail_sum, gathered = global_stats(1 / tau, [i[:, :-1] for i in local])
    support_exp = (gathered[:, :-1] - row_max[:, None]).exp()  # [c, K]
    lse = row_max + (tail_sum + support_exp.sum(-1)).log()  # [c]
    log_q_ids = gathered[:, :-1] - lse[:, None]  # [c, K]
    log_q_tail = tail_sum.log() + row_max - lse  # [c] log Q_tail, no 1 - s
    log_q_buckets = _student_buckets(log_q_ids, log_q_tail, tail).requires_grad_()  # [c, K(+1)]
    kd = _bucket_divergence(_teacher_buckets(teacher_logprobs, tail, tau), log_q_buckets, divergence)
    (g,) = torch.autograd.grad(kd.sum(), log_q_buckets)  # df/dlog Q_b
    g_ids, g_tail = (g, g.new_zeros(c)) if tail == "none" else (g[:, :-1], g[:, -1])
    weight_kd = alpha * tau**2 * mask  # [c]
    q_ids, q_tail = log_q_ids.exp(), log_q_tail.exp()  # [c, K], [c]
    dense = -g_ids.sum(-1) - g_tail + g_tail / q_tail  # [c]
    sparse = g_ids - (g_tail / q_tail)[:, None] * q_ids  # [c, K]
    dense, sparse = weight_kd * dense, weight_kd[:, None] * sparse
    ce = {}
    label_coef = -(1 - alpha) * mask  # [c]: the one-hot part of dCE/dlogits
    if tau == 1.0:  # CE shares the KD softmax: fold it in
        dense = dense + (1 - alpha) * mask
    elif alpha < 1:
        ce_max, ce_sumexp, _ = global_stats(1.0, [None] * tp)
        ce = dict(ce_lse=(ce_max + ce_sumexp.log()).float(), ce_coef=((1 - alpha) * mask).float())
    sparse = torch.cat([sparse, (label_coef * tau)[:, None]], -1)  # sparse is multiplied by scale = 1 / tau
    grads = [chunk_logit_grad_(z, lse.float(), dense.float(), i, sparse.float(), 1 / tau, **ce, kernels=kernels)
             for z, i in zip(shards, local)]  # G_r [c, Vp], in place
    d_hidden = sum(G.double() @ weight[r * Vp:(r + 1) * Vp] for r, G in enumerate(grads))  # all-reduce SUM
    d_weight = torch.cat([G.double().t() @ hidden for G in grads])
    return d_hidden, d_weight


@pytest.mark.parametrize(("tail", "divergence", "tau", "alpha", "tp", "dtype"), [
    ("ghost", "forward_kl", 1.0, 1.0, 1, torch.float32),
    ("ghost", "forward_kl", 2.0, 1.0, 2, torch.float32),
    ("ghost", "reverse_kl", 0.7, 1.0, 2, torch.float32),
    ("ghost", "jsd", 1.5, 0.6, 2, torch.float32),  # CE at tau = 1 beside KD at tau != 1: the ce_* term
    ("none", "forward_kl", 1.0, 0.4, 2, torch.float32),  # CE folded into the dense coefficient
    ("ghost", "forward_kl", 1.3, 0.5, 2, torch.bfloat16),
])
def test_chunk_gradient_times_weight_is_autograd_dx(tail, divergence, tau, alpha, tp, dtype):
    g = torch.Generator().manual_seed(7)
    c, H, V, K = 13, 16, 246, 5
    hidden = torch.randn(c, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 2
    teacher_logprobs, teacher_ids = torch.log_softmax(torch.randn(c, V, generator=g, dtype=torch.float64) * 2,
                                                      -1).topk(K, -1)  # distinct ids, mass m < 1
    labels = torch.randint(0, V, (c,), generator=g)
    mask = (torch.rand(c, generator=g) > 0.2).double()
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = _kd_loss(x, w, teacher_ids, teacher_logprobs, labels, mask, tail, divergence, tau, alpha)
    truth_dx, truth_dw = torch.autograd.grad(loss, (x, w))
    to = {"device": DEVICE}
    d_hidden, d_weight = _kernel_grads(hidden.to(**to), weight.to(**to), teacher_ids.to(**to),
                                       teacher_logprobs.to(**to), labels.to(**to), mask.to(**to), tail, divergence,
                                       tau, alpha, tp, dtype, "triton")
    rel = 2e-5 if dtype == torch.float32 else 3e-2  # bf16 logits and gradient: ~2^-8 per element
    for value, truth in ((d_hidden, truth_dx), (d_weight, truth_dw)):
        err = (value.cpu() - truth).norm() / truth.norm()
        assert err <= rel, (err.item(), rel)
