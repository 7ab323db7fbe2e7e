"""Top-p stores (``cache --top-p P --min-k M``, ``--topk K`` the cap; issue #21): per token the smallest prefix of
the teacher's ranked top-K whose mass reaches P, at least M ids; the row's other slots are padding (id 0, log-prob
-inf, first in the row: ``format.py``, ``topk.top_p_mask``). Read as top-K rows."""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.kinds.top_k_store import TopKStore, topk_statistics


class TopPStore(TopKStore):
    """The teacher's top-p, capped at K (module docstring)."""

    name = "top-p"
    fields = {"top_p": None, "min_k": None}
    described_fields = ("top_p", "min_k")

    def holds(self, spec) -> bool:
        return getattr(spec, "top_p", None) is not None

    def defaults(self, spec):
        return {"min_k": 1} if spec.min_k is None else {}

    def check(self, spec) -> None:
        super().check(spec)
        if not 0.0 < spec.top_p <= 1.0:
            raise ValueError(f"top_p={spec.top_p}: expected 0 < top_p <= 1")
        if not 1 <= spec.min_k <= spec.k:
            raise ValueError(f"min_k={spec.min_k}: expected 1 <= min_k <= k={spec.k}")

    def kept(self, spec, logprobs):
        from megatron_kd_plugin.cache.kinds.topk import top_p_mask

        return top_p_mask(logprobs, spec.top_p, spec.min_k)

    def describe(self, spec) -> str:
        return f"top-p, P={spec.top_p}, min-k={spec.min_k}, at most K={spec.k} ids per token (the rest padding)"

    def statistics(self, ids, logprobs):
        mass, entropy = topk_statistics(logprobs)
        return {"kept ids per token": np.isfinite(logprobs).sum(-1).ravel(), "mass kept": mass.ravel(),
                "entropy (nats, K+1 buckets)": entropy.ravel()}
