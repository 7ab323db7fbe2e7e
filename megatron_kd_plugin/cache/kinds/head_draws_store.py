"""Head + draws stores (``cache --head H --draws N``, issue #40): per token the exact top-H ids, then N ids drawn
from the teacher restricted to the rest (``head_draws.py``: the math, the estimator and its proof). Rows are a
``loss.SampledTeacher`` weighed p at the head and (1 - m)/N at each draw; ``kd.tail='sampled'`` reads them (the
head exact, the tail unbiased)."""

from __future__ import annotations

from megatron_kd_plugin.cache.store.array_names import IDS, LOGPROBS, LOGSUMEXP
from megatron_kd_plugin.cache.kinds.draws_store import DrawsStore


class HeadDrawsStore(DrawsStore):
    """The exact top-H, then N draws from the rest (module docstring); k = H + N slots."""

    name = "head + draws"
    fields = DrawsStore.fields | {"head": 0}
    described_fields = ("head",)
    work_bytes_per_logit = 4 + DrawsStore.work_bytes_per_logit      # the head-masked float32 copy, then the draws'

    def holds(self, spec) -> bool:
        return bool(getattr(spec, "head", 0))

    def check(self, spec) -> None:
        super().check(spec)
        if spec.proposal_temperature != 1.0:
            raise ValueError(f"head={spec.head} with proposal_temperature={spec.proposal_temperature}: the draws "
                             "beside a head follow the teacher itself (t = 1)")
        if not 1 <= spec.head < min(spec.k, spec.vocab_size):
            raise ValueError(f"head={spec.head}: expected 1 <= head < k={spec.k} (k = head + draws) and < "
                             f"vocab_size={spec.vocab_size}")

    def token_arrays(self, spec):
        return ()

    def teacher_rows(self, logits, spec, *, block, tp_group):
        from megatron_kd_plugin.cache.kinds.draws import draw_uniforms
        from megatron_kd_plugin.cache.kinds.head_draws import vocab_parallel_head_draws

        p, n = logits.shape[:2]
        uniforms = draw_uniforms(spec.sample_seed, block.first_sample, n, p, spec.k - spec.head,
                                 first_position=block.first_position)
        rows = vocab_parallel_head_draws(logits, uniforms, spec.head, temperature=spec.temperature,
                                         tp_group=tp_group)
        return {IDS: rows.ids, LOGPROBS: rows.logprobs, LOGSUMEXP: rows.logsumexp}, rows.finite

    def weights(self, spec, rows):
        from megatron_kd_plugin.cache.kinds.head_draws import head_draw_weights

        return (head_draw_weights(rows[LOGPROBS].float(), spec.head),)

    def describe(self, spec) -> str:
        return f"head + draws, the top-{spec.head} ids then N={spec.k - spec.head} draws from the rest per token"
