"""Vocab-parallel top-K extraction equals the top-K of the gathered logits (TP=1/2/4 on gloo, ties included)."""

import pytest
import torch

from megatron_kd_plugin.cache.kinds.topk import topk_by_value_then_id, vocab_parallel_topk
from tests.distributed import run_on_ranks

S, B, V = 7, 3, 48


def reference_topk(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """Float64 dense reference: (ids by (value desc, id asc), log-probs, logsumexp)."""
    z = logits.double() / temperature
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices[..., :k]
    log_softmax = torch.log_softmax(z, dim=-1)
    return order, log_softmax.gather(-1, order), torch.logsumexp(z, dim=-1)


def make_logits(seed: int, *, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:   # few distinct values: every row has ties at the K-th place
        return torch.randint(0, 4, (S, B, V), generator=g).float()
    return 3 * torch.randn(S, B, V, generator=g)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 5, 48])
def test_topk_by_value_then_id_is_a_stable_sort_prefix(ties, k):
    x = make_logits(k, ties=ties)
    values, ids = topk_by_value_then_id(x, k)
    expected = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, expected.indices[..., :k]) and torch.equal(values, expected.values[..., :k])


def test_single_rank_matches_float64_reference_with_temperature():
    x = make_logits(0, ties=False)
    top = vocab_parallel_topk(x, 9, temperature=1.7)
    ids, logprobs, lse = reference_topk(x, 9, 1.7)
    assert torch.equal(top.ids, ids)
    torch.testing.assert_close(top.logprobs.double(), logprobs, atol=2e-6, rtol=0)
    torch.testing.assert_close(top.logsumexp.double(), lse, atol=2e-6, rtol=0)
    assert top.finite.all()


def test_non_finite_logits_are_flagged_per_token():
    x = make_logits(1, ties=False)
    x[2, 1, 5] = float("nan")
    x[4, 0, 0] = float("inf")
    x[5, 2, :] = float("-inf")              # -inf inside the top-K
    x[0, 0, 3] = float("-inf")              # -inf outside the top-K: probability 0, fine
    top = vocab_parallel_topk(x, 4)
    expected = torch.ones(S, B, dtype=torch.bool)
    expected[2, 1] = expected[4, 0] = expected[5, 2] = False
    assert torch.equal(top.finite, expected)


@pytest.mark.parametrize("bad", [dict(k=0), dict(k=V + 1), dict(k=3, temperature=0.0)])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        vocab_parallel_topk(make_logits(0, ties=False), **bad)


CASES = [(k, ties, temperature) for k in (1, 5, 12, 30) for ties in (False, True) for temperature in (1.0, 0.5)]


def _tp_topk_cases(tp_sizes):
    """On each of 4 ranks, for each TP size: every case computed from this rank's vocab shard."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    results = {}
    for tp in tp_sizes:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        group = parallel_state.get_tensor_model_parallel_group()
        rank = dist.get_rank(group)
        results[tp] = []
        for case, (k, ties, temperature) in enumerate(CASES):
            full = make_logits(case, ties=ties)
            if case == 3:
                full[1, 2, V - 1] = float("nan")          # on the last rank's shard only
            shard = full.chunk(tp, dim=-1)[rank]                                  # [s, b, V/tp]
            results[tp].append(vocab_parallel_topk(shard, k, temperature=temperature, tp_group=group))
    return results


def test_vocab_parallel_topk_equals_gathered_topk_at_tp2_and_tp4():
    per_rank = run_on_ranks(4, _tp_topk_cases, (2, 4))            # one spawn of 4 ranks, both TP sizes
    for tp in (2, 4):
        for case, (k, ties, temperature) in enumerate(CASES):
            full = make_logits(case, ties=ties)
            ids, logprobs, lse = reference_topk(full, k, temperature)
            finite = torch.ones(S, B, dtype=torch.bool)
            if case == 3:
                finite[1, 2] = False
            for rank in range(4):
                top = per_rank[rank][tp][case]
                assert torch.equal(top.finite, finite), (tp, case, rank)
                # K >= V/tp for k=30 at TP=2 and TP=4
                assert torch.equal(top.ids[finite], ids[finite]), (tp, case, rank)
                torch.testing.assert_close(top.logprobs.double()[finite], logprobs[finite], atol=5e-6, rtol=0)
                torch.testing.assert_close(top.logsumexp.double()[finite], lse[finite], atol=5e-6, rtol=0)
                assert torch.equal(top.ids, per_rank[0][tp][case].ids)
