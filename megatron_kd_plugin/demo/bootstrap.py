"""How sure the demo is that one heal beat the other: a paired bootstrap over held-out documents.

Two models a (the KD heal) and b (the CE heal) are evaluated on the same held-out tokens, each token in one of D
documents (``metrics.evaluate``'s ``by_document`` sums; documents without an evaluated token are left out). Per
document d: n_d tokens, the summed negative log-likelihoods A_d, B_d and the summed KL(teacher ‖ model) K^a_d,
K^b_d. Documents, not tokens, are resampled: tokens of one file are not independent draws.

One resample r draws D documents with replacement, ``torch.randint(D, (R, D))`` from
``torch.Generator().manual_seed(seed)``; c_rd counts how often document d was drawn (c [R, D]). Per resample:

    perplexity ratio - 1   p_r = exp( Σ_d c_rd (A_d - B_d) / Σ_d c_rd n_d ) - 1      = ppl_a / ppl_b - 1
    KL difference          k_r = Σ_d c_rd (K^a_d - K^b_d) / Σ_d c_rd n_d             = KL_a - KL_b  (nats/token)

The same draw serves both models and both measures (paired). The estimate is the formula at c = 1 (every document
once: the evaluation itself); the interval is the (1 - level) / 2 and (1 + level) / 2 quantiles of the R values
(``torch.quantile``, linear interpolation). a beats b in a measure when its whole interval lies below 0.

Shapes: the per-document sums [D] float64; counts [R, D].
"""

from __future__ import annotations

import dataclasses

import torch

RESAMPLES = 4000
SEED = 0
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """An estimate and its bootstrap interval."""

    estimate: float
    low: float
    high: float

    @property
    def below_zero(self) -> bool:
        return self.high < 0


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Model a against model b on the same documents."""

    perplexity: Interval
    """ppl_a / ppl_b - 1."""
    kl: Interval
    """KL_a - KL_b, nats/token."""
    documents: int
    """Documents resampled."""


def paired_bootstrap(a: dict, b: dict, *, resamples: int = RESAMPLES, seed: int = SEED,
                     level: float = LEVEL) -> Comparison:
    """``a``, ``b``: two models' ``by_document`` sums ({"nll", "kl", "tokens"}: one value per document, the same
    documents in the same order). See the module's docstring."""
    if a["tokens"] != b["tokens"]:
        raise ValueError("paired_bootstrap: the two models were not evaluated on the same tokens per document")
    sums = torch.tensor([a["nll"], b["nll"], a["kl"], b["kl"], a["tokens"]], dtype=torch.float64)   # [5, D']
    sums = sums[:, sums[4] > 0]                                                                    # [5, D]
    if sums.shape[1] == 0:
        raise ValueError("paired_bootstrap: no document holds an evaluated token")
    documents = sums.shape[1]
    draws = torch.randint(documents, (resamples, documents), generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(resamples, documents, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(resamples, documents, dtype=torch.float64))                            # [R, D]
    every = torch.ones(1, documents, dtype=torch.float64)                                          # c = 1
    quantiles = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)

    def interval(difference: torch.Tensor, transform) -> Interval:
        def value(c: torch.Tensor) -> torch.Tensor:                                                # [R]
            return transform((c @ difference) / (c @ sums[4]))

        low, high = torch.quantile(value(counts), quantiles).tolist()
        return Interval(estimate=value(every).item(), low=low, high=high)

    return Comparison(perplexity=interval(sums[0] - sums[1], torch.expm1),
                      kl=interval(sums[2] - sums[3], lambda x: x), documents=documents)


def verdict(comparison: Comparison, a: str = "KD", b: str = "CE") -> str:
    """One sentence: "a beats b" only when both intervals lie below 0; otherwise which measure is not resolved
    (or goes the other way)."""
    level = f"{LEVEL:.0%}"
    if comparison.perplexity.below_zero and comparison.kl.below_zero:
        return (f"{a} beats {b}: perplexity and KL to the teacher both lower, each {level} interval below 0 "
                f"({comparison.documents} held-out documents resampled).")
    open_ = [f"{name} ({'the other way' if i.low > 0 else 'interval crosses 0'})"
             for name, i in (("perplexity", comparison.perplexity), ("KL to the teacher", comparison.kl))
             if not i.below_zero]
    return (f"{a} does NOT beat {b} beyond the {level} error bar: not resolved in {' and '.join(open_)} "
            f"({comparison.documents} held-out documents resampled).")
