"""Sampled stores (``cache --draws N``, issue #8): per token N ids drawn from the proposal q ∝ p^(1/t), sorted
ascending with repeats kept, their teacher log-probs and, when t != 1, the proposal's log-normaliser G
(``format.py``, ``draws.py``). Rows are a ``loss.SampledTeacher`` weighed w = (1/N) exp(l (1 - 1/t) + G)
(``draws.draw_weights``); only ``kd.tail='sampled'`` reads them (an unbiased estimate of the full-vocab KL)."""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.store.array_names import IDS, LOGPROBS, LOGSUMEXP, PROPOSAL_LOGNORM
from megatron_kd_plugin.cache.kinds.store_kind import StoreKind


def sampled_statistics(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids ``[...]``, teacher mass of the distinct ids ``[...]``) of sorted draws ``[..., N]``."""
    first = np.ones(ids.shape, dtype=bool)
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return first.sum(-1), np.where(first, np.exp(logprobs.astype(np.float64)), 0.0).sum(-1)


class DrawsStore(StoreKind):
    """N draws per token from the teacher (module docstring)."""

    name = "sampled"
    mode = "sampled"
    fields = {"proposal_temperature": 1.0, "sample_seed": 0}
    slot = "draw"
    default_codec = "fp16-bitround7"
    grid_codec = False
    exact_slots = False
    work_bytes_per_logit = 13           # the float32 tempered logits (exponentiated in place), their float64 CDF, a mask

    def holds(self, spec) -> bool:
        return spec.mode == self.mode

    def check(self, spec) -> None:
        if not spec.proposal_temperature > 0:
            raise ValueError(f"proposal_temperature must be > 0, got {spec.proposal_temperature}")
        if spec.sample_seed < 0:
            raise ValueError(f"sample_seed must be >= 0, got {spec.sample_seed}")

    def token_arrays(self, spec):
        """G per token only when t != 1 (else G = 0)."""
        return (PROPOSAL_LOGNORM,) if spec.proposal_temperature != 1.0 else ()

    @property
    def teacher_type(self):
        from megatron_kd_plugin.loss import SampledTeacher

        return SampledTeacher

    def teacher_rows(self, logits, spec, *, block, tp_group):
        from megatron_kd_plugin.cache.kinds.draws import draw_uniforms, vocab_parallel_draws

        p, n = logits.shape[:2]
        uniforms = draw_uniforms(spec.sample_seed, block.first_sample, n, p, spec.k, first_position=block.first_position)
        draw = vocab_parallel_draws(logits, uniforms,
                                    temperature=spec.temperature, proposal_temperature=spec.proposal_temperature,
                                    tp_group=tp_group)
        rows = {IDS: draw.ids, LOGPROBS: draw.logprobs, LOGSUMEXP: draw.logsumexp}
        return rows | {name: draw.proposal_lognorm for name in self.token_arrays(spec)}, draw.finite

    def weights(self, spec, rows):
        from megatron_kd_plugin.cache.kinds.draws import draw_weights

        return (draw_weights(rows[LOGPROBS].float(), rows.get(PROPOSAL_LOGNORM), spec.proposal_temperature),)

    def describe(self, spec) -> str:
        return f"sampled, N={spec.k} draws per token, proposal temperature {spec.proposal_temperature}"

    def statistics(self, ids, logprobs):
        distinct, mass = sampled_statistics(ids, logprobs)
        return {"distinct ids": distinct.ravel(), "mass of the drawn ids": mass.ravel()}
