"""Head + draws rows (issue #40): the head is the exact top-H, the draws follow the teacher restricted to the rest,
the loss's estimator on them is unbiased for KL(p || q) and its gradient (float64 dense reference, the fused loss's
own values), and TP=2 writes the TP=1 rows."""

import pytest
import torch

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.kinds.draws import draw_uniforms
from megatron_kd_plugin.cache.kinds.head_draws import head_draw_weights, vocab_parallel_head_draws
from megatron_kd_plugin.loss import SampledTeacher, topk_kd_loss
from tests.distributed import run_on_ranks

S, B, V, HEAD = 4, 2, 30, 5


def make_logits(seed: int) -> torch.Tensor:
    logits = 2 * torch.randn(S, B, V, generator=torch.Generator().manual_seed(seed))
    logits[0, 0, 7] = float("-inf")                 # a zero-probability id is never drawn
    return logits


def test_head_is_the_exact_top_h_and_the_draws_follow_the_rest():
    logits, n = make_logits(0), 20000
    rows = vocab_parallel_head_draws(logits, draw_uniforms(7, 0, B, S, n), HEAD, temperature=1.3)
    l = torch.log_softmax(logits.double() / 1.3, dim=-1)                              # [s, b, V]
    head = l.topk(HEAD, dim=-1).indices.sort(dim=-1).values
    assert rows.finite.all() and rows.ids.shape == (S, B, HEAD + n)
    assert torch.equal(rows.ids[..., :HEAD], head)
    torch.testing.assert_close(rows.logprobs.double(), l.gather(-1, rows.ids), atol=2e-6, rtol=0)
    torch.testing.assert_close(rows.logsumexp.double(), torch.logsumexp(logits.double() / 1.3, -1), atol=1e-5,
                               rtol=0)
    draws = rows.ids[..., HEAD:]
    assert not (draws.unsqueeze(-1) == head.unsqueeze(-2)).any()                     # never a head id
    tail = l.exp().scatter(-1, head, 0.0)
    tail = tail / tail.sum(-1, keepdim=True)                                          # p(v | T)
    counts = torch.zeros(S, B, V, dtype=torch.float64).scatter_add_(-1, draws, torch.ones_like(draws, dtype=torch.float64))
    assert counts[0, 0, 7] == 0
    assert ((counts - n * tail).abs() <= 5 * (n * tail * (1 - tail)).sqrt() + 1).all()
    weights = head_draw_weights(rows.logprobs, HEAD).double()
    torch.testing.assert_close(weights.sum(-1), torch.ones(S, B, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(weights[..., :HEAD], l.gather(-1, head).exp(), atol=1e-6, rtol=0)


def test_the_loss_on_head_and_draws_is_unbiased_for_kl_and_its_gradient():
    """R tokens with one teacher and one student (hidden h, W: q = softmax(W h)), each with its own N = 6 draws:
    the fused loss (tail='sampled', float64) per token is f_t = sum_k w_k (l_k - log q_{I_k}); the mean of f_t and of
    dX_t lie within 5 standard errors of KL(p || q) and (q - p) W, float64 dense."""
    gen = torch.Generator().manual_seed(3)
    repeats, hidden_size, n = 3000, 6, 6
    teacher = torch.randn(V, generator=gen, dtype=torch.float64) * 2
    weight = torch.randn(V, hidden_size, generator=gen, dtype=torch.float64)
    h = torch.randn(hidden_size, generator=gen, dtype=torch.float64)
    rows = vocab_parallel_head_draws(teacher.expand(repeats, 1, V), draw_uniforms(11, 0, 1, repeats, n), HEAD)
    ids, logprobs = rows.ids, rows.logprobs.double()                                   # [R, 1, H + N]
    hidden = h.expand(repeats, 1, hidden_size).clone().requires_grad_()
    result = topk_kd_loss(hidden, weight, SampledTeacher(ids, logprobs, head_draw_weights(logprobs, HEAD).double()),
                          tail="sampled", impl="fused", kernels="torch")
    result.loss_sum.backward()
    log_q = torch.log_softmax(weight @ h, -1)                                         # [V]
    w = head_draw_weights(logprobs, HEAD).double()[:, 0]                                  # [R, H + N]
    per_token = (w * (logprobs[:, 0] - log_q[ids[:, 0]])).sum(-1)                      # [R] f_t
    torch.testing.assert_close(result.loss_sum, per_token.sum(), atol=1e-9, rtol=1e-9)  # the loss computes f_t
    p = torch.log_softmax(teacher, -1).exp()
    kl = (p * (p.log() - log_q)).sum()
    assert (per_token.mean() - kl).abs() <= 5 * per_token.std() / repeats ** 0.5
    dx = hidden.grad[:, 0]                                                              # [R, H]
    exact = (log_q.exp() - p) @ weight                                                  # [H]
    assert ((dx.mean(0) - exact).abs() <= 5 * dx.std(0) / repeats ** 0.5 + 1e-12).all()
    assert (dx.std(0) > 0).all()                                                       # the draws are random
    # the test's power: draws weighed 1/N (as draws from the whole distribution are) miss by far more than 5 SE
    wrong = torch.cat([w[:, :HEAD], torch.full_like(w[:, HEAD:], 1.0 / n)], -1)          # [R, H + N]
    p_hat = torch.zeros(repeats, V, dtype=torch.float64).scatter_add_(-1, ids[:, 0], wrong)
    wrong_dx = (log_q.exp() * wrong.sum(-1, keepdim=True) - p_hat) @ weight              # [R, H]
    assert ((wrong_dx.mean(0) - exact).abs() > 5 * wrong_dx.std(0) / repeats ** 0.5).any()


def _tp_head_draws(head):
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    logits = make_logits(2)
    shard = logits.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)]
    return vocab_parallel_head_draws(shard, draw_uniforms(5, 0, B, S, 32), head, temperature=0.9, tp_group=group)


def test_tensor_parallel_rows_equal_single_rank_rows():
    single = vocab_parallel_head_draws(make_logits(2), draw_uniforms(5, 0, B, S, 32), HEAD, temperature=0.9)
    for rows in run_on_ranks(2, _tp_head_draws, HEAD):
        assert torch.equal(rows.ids, single.ids) and rows.finite.all()
        torch.testing.assert_close(rows.logprobs, single.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fields,message", [
    (dict(mode="topk", head=2), "head=2 makes a head \\+ draws store, of mode 'sampled', not mode='topk'"),
    (dict(mode="sampled", head=2, proposal_temperature=1.5), "the draws beside a head follow the teacher itself"),
    (dict(mode="sampled", head=8), "expected 1 <= head < k=8"),
])
def test_spec_refuses_a_head_it_cannot_store(fields, message):
    with pytest.raises(ValueError, match=message):
        fmt.CacheSpec(k=8, vocab_size=V, seq_length=4, num_samples=2, **fields)


def test_a_head_is_part_of_the_identity_and_absent_without_one():
    base = dict(k=8, vocab_size=V, seq_length=4, num_samples=2, mode="sampled")
    assert "head" not in fmt.CacheSpec(**base).to_attrs()
    assert fmt.store_identity(fmt.CacheSpec(**base, head=2)) != fmt.store_identity(fmt.CacheSpec(**base))
    assert fmt.CacheSpec.from_attrs(fmt.CacheSpec(**base, head=2).to_attrs()).head == 2
