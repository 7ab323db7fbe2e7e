"""Vocab-parallel sampling for the sampled cache: frequencies follow q ∝ p^(1/t), l and G equal a float64 dense
log_softmax, the importance weights are unbiased for p, and TP=2/4 draw exactly what TP=1 draws."""

import pytest
import torch

from megatron_kd_plugin.cache.kinds.draws import draw_uniforms, draw_weights, shard_offsets, vocab_parallel_draws
from tests.distributed import run_on_ranks

S, B, V = 5, 2, 24


def make_logits(seed: int) -> torch.Tensor:
    logits = 2 * torch.randn(S, B, V, generator=torch.Generator().manual_seed(seed))
    logits[0, 0, 3] = float("-inf")                 # a zero-probability id is never drawn
    return logits


def dense(logits, temperature, proposal_temperature):
    """float64 (l [s, b, V], log q [s, b, V], G [s, b])."""
    l = torch.log_softmax(logits.double() / temperature, dim=-1)
    lognorm = torch.logsumexp(l / proposal_temperature, dim=-1)
    return l, l / proposal_temperature - lognorm.unsqueeze(-1), lognorm


@pytest.mark.parametrize("t", [1.0, 1.5])
def test_frequencies_follow_q_and_values_match_a_dense_log_softmax(t):
    logits, n = make_logits(0), 20000
    draw = vocab_parallel_draws(logits, draw_uniforms(7, 0, B, S, n), temperature=1.3, proposal_temperature=t)
    l, log_q, lognorm = dense(logits, 1.3, t)
    assert draw.finite.all() and (draw.ids.diff(dim=-1) >= 0).all()
    torch.testing.assert_close(draw.logprobs.double(), l.gather(-1, draw.ids), atol=1e-6, rtol=0)
    torch.testing.assert_close(draw.proposal_lognorm.double(), lognorm, atol=1e-6, rtol=0)
    counts = torch.zeros(S, B, V, dtype=torch.float64).scatter_add_(-1, draw.ids, torch.ones_like(draw.ids,
                                                                                                   dtype=torch.float64))
    q = log_q.exp()
    assert counts[0, 0, 3] == 0
    # per id, |count - n q| < 5 binomial standard deviations (+1 for q ~ 0); chi-square over all ids
    assert ((counts - n * q).abs() <= 5 * (n * q * (1 - q)).sqrt() + 1).all()
    chi2 = ((counts - n * q) ** 2 / (n * q).clamp(min=1e-12)).where(q > 0, 0.0).sum(-1)     # ~ V-1 = 23 dof
    assert (chi2 < 60).all(), chi2


@pytest.mark.parametrize("t", [1.0, 1.5])
def test_importance_weights_are_unbiased_for_p(t):
    """P̂_v = Σ_n [i_n = v] w_n over many independent draws of N = 8: mean -> p within 5 standard errors."""
    logits, n, repeats = make_logits(1), 8, 4000
    uniforms = draw_uniforms(3, 0, B * repeats, S, n).view(S, repeats, B, n).transpose(1, 2)   # [s, b, R, N]
    draw = vocab_parallel_draws(logits.unsqueeze(2).expand(S, B, repeats, V), uniforms, proposal_temperature=t)
    weights = draw_weights(draw.logprobs, draw.proposal_lognorm, t).double()
    p_hat = torch.zeros(S, B, repeats, V, dtype=torch.float64).scatter_add_(-1, draw.ids, weights)
    l, log_q, _ = dense(logits, 1.0, t)
    p = l.exp()
    error = (p_hat.mean(2) - p).abs()
    # Var P̂_v = (p²/q − p²) / N per repeat; 0/0 = 0 for the zero-probability id
    standard_error = ((p * p / log_q.exp() - p * p) / (n * repeats)).sqrt().nan_to_num()
    assert (error <= 5 * standard_error + 1e-12).all()
    assert error.max() > 0                                                      # the draws are random
    torch.testing.assert_close(p_hat.sum(-1).mean(), torch.tensor(1.0, dtype=torch.float64), atol=0.02, rtol=0)
    if t == 1.0:
        assert torch.equal(weights, torch.full_like(weights, 1 / n))


def test_the_owner_of_a_draw_never_gets_a_target_below_its_shard():
    """u · ΣT at a shard's first end belongs to the next shard; its local target must be >= 0 (with ``ends - masses``
    as the offset, masses [0.1, 0.2] gave -2.8e-17 there, which drew the shard's first id whatever its weight)."""
    masses = torch.tensor([[0.1, 0.2], [0.3, 0.7], [1e-3, 0.123456789]], dtype=torch.float64)
    ends = masses.cumsum(-1)
    targets = torch.cat([ends[:, :1], torch.rand(3, 1000, dtype=torch.float64) * ends[:, -1:]], dim=-1)
    owner = torch.searchsorted(ends, targets, right=True).clamp(max=1)
    local = targets - shard_offsets(ends).gather(-1, owner)
    assert (local >= 0).all()
    assert torch.equal(shard_offsets(ends)[:, 0], torch.zeros(3, dtype=torch.float64))
    assert ((targets[:1, :1] - (ends - masses)[:1, 1:]) < 0).all()          # the old offset, at the boundary


def tp_case_logits():
    logits = make_logits(2)
    logits[1, 1, 18:] = float("-inf")                # the last shard at TP=4 has no mass for this token
    uniforms = draw_uniforms(5, 0, B, S, 64)
    uniforms[1, 1, :2] = 1.0                         # u · ΣT rounded up to ΣT: the last id with mass (17)
    return logits, uniforms


def _tp_draws(tp_sizes, proposal_temperatures):
    """On each of 4 ranks, for each TP size and t: the draws from this rank's vocab shard."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    logits, uniforms = tp_case_logits()
    results = {}
    for tp in tp_sizes:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        group = parallel_state.get_tensor_model_parallel_group()
        shard = logits.chunk(tp, dim=-1)[dist.get_rank(group)]                   # [s, b, V/tp]
        results[tp] = [vocab_parallel_draws(shard, uniforms, temperature=0.9, proposal_temperature=t,
                                             tp_group=group) for t in proposal_temperatures]
    return results


def test_tensor_parallel_draws_equal_single_rank_draws_at_tp2_and_tp4():
    logits, uniforms = tp_case_logits()
    temperatures = (1.0, 1.5)
    per_rank = run_on_ranks(4, _tp_draws, (2, 4), temperatures)          # one spawn of 4 ranks, both TP sizes
    for case, t in enumerate(temperatures):
        single = vocab_parallel_draws(logits, uniforms, temperature=0.9, proposal_temperature=t)
        assert (single.ids[1, 1] < 18).all() and (single.ids[1, 1, -2:] == 17).all() and single.finite.all()
        for tp in (2, 4):
            for rank in range(4):
                draw = per_rank[rank][tp][case]
                assert torch.equal(draw.ids, single.ids), (tp, t, rank)
                torch.testing.assert_close(draw.logprobs, single.logprobs, atol=1e-6, rtol=0)
                torch.testing.assert_close(draw.proposal_lognorm, single.proposal_lognorm, atol=1e-6, rtol=0)
                assert draw.finite.all()


def test_non_finite_logits_are_flagged_and_bad_arguments_raise():
    logits = make_logits(4)
    logits[2, 1, 7] = float("nan")
    logits[3, 0, 1] = float("inf")
    draw = vocab_parallel_draws(logits, draw_uniforms(0, 0, B, S, 4))
    expected = torch.ones(S, B, dtype=torch.bool)
    expected[2, 1] = expected[3, 0] = False
    assert torch.equal(draw.finite, expected)
    with pytest.raises(ValueError, match="proposal_temperature"):
        vocab_parallel_draws(logits, draw_uniforms(0, 0, B, S, 4), proposal_temperature=0.0)
    with pytest.raises(ValueError, match="uniforms"):
        vocab_parallel_draws(logits, draw_uniforms(0, 0, B + 1, S, 4))


def test_uniforms_of_a_block_of_positions_are_the_whole_streams():
    whole = draw_uniforms(1, 3, B, S, 6)
    for first, count in ((0, 2), (2, 1), (3, S - 3)):
        block = draw_uniforms(1, 4, 1, count, 6, first_position=first)              # sample 4, positions [first, ..)
        assert torch.equal(block, whole[first:first + count, 1:2])


def test_uniforms_depend_only_on_seed_and_sample_index():
    whole = draw_uniforms(9, 0, 6, S, 3)
    assert torch.equal(draw_uniforms(9, 4, 2, S, 3), whole[:, 4:])
    assert not torch.equal(draw_uniforms(8, 0, 6, S, 3), whole)
