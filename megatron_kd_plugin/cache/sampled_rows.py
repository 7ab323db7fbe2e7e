"""Sampled rows (a store of mode ``sampled``): N ids drawn per token from the teacher, for a student with the
teacher's tokenizer.

The store holds, per cached sample, the tokens and N drawn ids [S_c, N] (sorted, repeats kept) with the teacher's
log-prob of each, and, when the proposal temperature t != 1, each token's proposal log-normaliser G [S_c]
(``format.py``, ``draws.py``). A row is a window as in ``topk_rows`` whose teacher is a ``SampledTeacher``: the ids,
their log-probs and the importance weights w = (1/N) exp(l (1 - 1/t) + G) computed from them
(``draws.draw_weights``); a head + draws store's rows start with the exact top-H, weighed by their probabilities
(``head_draws.py``). Its loss is the top-K loss with ``tail="sampled"`` (forward KL at tau = 1), an unbiased
estimate of the full-vocab KL.
"""

from __future__ import annotations

from megatron_kd_plugin.cache import format as fmt
from megatron_kd_plugin.cache.head_draws import stored_draw_weights
from megatron_kd_plugin.cache.rows import KDRow, window_row
from megatron_kd_plugin.cache.topk_rows import TopKRows
from megatron_kd_plugin.loss import KDLossOptions, SampledTeacher


class SampledRows(TopKRows):
    """Windows of a sampled store for a student with the teacher's tokenizer (module docstring)."""

    mode = "sampled"
    teacher_type = SampledTeacher

    def validate(self, *, vocab_size: int | None = None, k: int | None = None) -> None:
        super().validate(vocab_size=vocab_size, k=k)
        try:
            fmt.check_logprob_codec(self.mode, self.reader.spec.logprob_codec)
        except ValueError as error:
            raise ValueError(f"{self.reader.path} was written with the {error}; rewrite the store with the same cache "
                             "command and --overwrite") from None

    def check_tail(self, options: KDLossOptions) -> None:
        if options.tail != "sampled":
            raise ValueError(f"kd.tail={options.tail!r} does not fit the sampled store {self.reader.path}: its slots "
                             "are draws, not a top-K; use kd.tail='sampled'")

    def row(self, sample: int, window: int) -> KDRow:
        spec = self.reader.spec
        names = (fmt.IDS, fmt.LOGPROBS) + ((fmt.PROPOSAL_LOGNORM,) if spec.stores_proposal_lognorm else ())
        tokens, rows = self._window(sample, window, names)
        weights = stored_draw_weights(spec, rows[fmt.LOGPROBS].float(), rows.get(fmt.PROPOSAL_LOGNORM))
        return window_row(tokens, SampledTeacher(rows[fmt.IDS], rows[fmt.LOGPROBS], weights))
