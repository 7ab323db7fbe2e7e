"""The demo's verdict: the paired bootstrap over held-out documents against a direct computation, and the verdict
that claims a win only when both intervals lie below 0."""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.demo.bootstrap import Comparison, Interval, paired_bootstrap, verdict


def _by_document(nll: list[torch.Tensor], kl: list[torch.Tensor]) -> dict:
    return {"nll": [float(x.sum()) for x in nll], "kl": [float(x.sum()) for x in kl],
            "tokens": [float(len(x)) for x in nll]}


def test_paired_bootstrap_matches_a_direct_computation():
    """Per-token values of two models on documents of unequal length (one empty: left out); each resample rebuilt
    from the tokens of the drawn documents, its perplexity ratio and KL difference computed from them directly."""
    gen = torch.Generator().manual_seed(0)
    lengths = [30, 0, 7, 55, 12, 40, 3, 21]
    nll_a = [torch.rand(n, generator=gen, dtype=torch.float64) * 6 for n in lengths]
    nll_b = [x + 0.1 * torch.randn(len(x), generator=gen, dtype=torch.float64) + 0.03 for x in nll_a]
    kl_a = [torch.rand(n, generator=gen, dtype=torch.float64) * 0.1 for n in lengths]
    kl_b = [torch.rand(n, generator=gen, dtype=torch.float64) * 0.5 for n in lengths]
    resamples, seed = 300, 11
    got = paired_bootstrap(_by_document(nll_a, kl_a), _by_document(nll_b, kl_b), resamples=resamples, seed=seed)

    kept = [d for d, n in enumerate(lengths) if n]
    draws = torch.randint(len(kept), (resamples, len(kept)), generator=torch.Generator().manual_seed(seed))

    def measures(documents: list[int]) -> tuple[float, float]:
        a, b = (torch.cat([x[d] for d in documents]) for x in (nll_a, nll_b))
        ka, kb = (torch.cat([x[d] for d in documents]) for x in (kl_a, kl_b))
        return float(a.mean().exp() / b.mean().exp() - 1), float(ka.mean() - kb.mean())

    direct = torch.tensor([measures([kept[i] for i in row]) for row in draws.tolist()], dtype=torch.float64)
    low_high = torch.quantile(direct, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)   # [2, 2]
    whole = measures(kept)
    assert got.documents == len(kept)
    assert got.perplexity.estimate == pytest.approx(whole[0], rel=1e-10)
    assert got.kl.estimate == pytest.approx(whole[1], rel=1e-10)
    assert (got.perplexity.low, got.perplexity.high) == pytest.approx(low_high[:, 0].tolist(), rel=1e-10)
    assert (got.kl.low, got.kl.high) == pytest.approx(low_high[:, 1].tolist(), rel=1e-10)
    assert got.perplexity.low < got.perplexity.estimate < got.perplexity.high
    again = paired_bootstrap(_by_document(nll_a, kl_a), _by_document(nll_b, kl_b), resamples=resamples, seed=seed)
    assert again == got                                                       # a fixed seed: the same interval
    with pytest.raises(ValueError, match="same tokens"):
        paired_bootstrap(_by_document(nll_a, kl_a), _by_document(nll_b[1:], kl_b[1:]))


def test_verdict_claims_a_win_only_when_both_intervals_lie_below_zero():
    below, crossing, above = Interval(-0.03, -0.05, -0.01), Interval(-0.01, -0.03, 0.004), Interval(0.02, 0.01, 0.03)
    assert verdict(Comparison(perplexity=below, kl=below, documents=80)).startswith("KD beats CE:")
    for perplexity, kl, unresolved in ((crossing, below, ["perplexity (interval crosses 0)"]),
                                       (below, crossing, ["KL to the teacher (interval crosses 0)"]),
                                       (above, crossing, ["perplexity (the other way)",
                                                          "KL to the teacher (interval crosses 0)"])):
        text = verdict(Comparison(perplexity=perplexity, kl=kl, documents=80))
        assert text.startswith("KD does NOT beat CE") and "beats" not in text, text
        assert all(item in text for item in unresolved), text
    assert not Interval(-0.02, -0.04, 0.0).below_zero                         # touching 0 is not below it
