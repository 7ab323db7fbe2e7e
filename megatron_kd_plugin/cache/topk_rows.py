"""Top-K rows (a store of mode ``topk``, top-p stores included): what a student with the teacher's tokenizer reads.

The store holds, per cached sample of S_c tokens, the tokens [S_c + 1] and each token's top-K ids and log-probs
[S_c, K] (``format.py``; a top-p store pads its rows with id 0 / -inf). A student of seq_length S (S divides S_c)
reads S_c / S windows per sample; window w of sample i is the row

    tokens  = cache.tokens[i][w*S : w*S + S]      labels = cache.tokens[i][w*S + 1 : w*S + S + 1]
    teacher = TopKTeacher(cache.teacher_ids[i][w*S : w*S + S], cache.teacher_logprobs[i][w*S : w*S + S])   # [S, K]

in the store's dtypes (int32 ids; the decoded log-probs), loss_mask 1, position_ids 0..S-1. Its loss is the top-K
loss (``loss.topk_kd_loss``) with any tail but ``sampled``.
"""

from __future__ import annotations

import torch

from megatron_kd_plugin.cache import format as fmt
from megatron_kd_plugin.cache.rows import KDRow, RowKind, window_row
from megatron_kd_plugin.loss import KDLossOptions, TopKTeacher
from megatron_kd_plugin.loss.options import check_training_options


class TopKRows(RowKind):
    """Windows of a top-K store for a student with the teacher's tokenizer (module docstring)."""

    mode = "topk"
    teacher_type = TopKTeacher

    def __init__(self, reader, **kwargs):
        super().__init__(reader, **kwargs)
        reader.validate(seq_length=self.seq_length)

    @classmethod
    def serves(cls, spec, student) -> bool:
        return student is None and spec.mode == cls.mode

    def validate(self, *, vocab_size: int | None = None, k: int | None = None) -> None:
        self.reader.validate(vocab_size=vocab_size, seq_length=self.seq_length, k=k)

    def check(self, options: KDLossOptions, *, context_parallel_size: int = 1, heal: bool = False) -> list[str]:
        self.check_tail(options)
        if options.token_weight > 0:
            raise ValueError(f"kd.token_weight={options.token_weight} is for a student with its own tokenizer: set "
                             "dataset.student_tokenizer to the student's tokenizer, or kd.token_weight=0")
        return check_training_options(options, heal=heal)

    def check_tail(self, options: KDLossOptions) -> None:
        """ValueError for a tail these slots cannot serve."""
        if options.tail == "sampled":
            raise ValueError(f"kd.tail='sampled' does not fit the {self.mode} store {self.reader.path}: it needs a "
                             "store written with --draws N; use kd.tail='renorm' (a student from trained weights) or "
                             "'ghost'")

    def rows_per_sample(self) -> int:
        return self.reader.spec.seq_length // self.seq_length

    def _window(self, sample: int, window: int, names: tuple[str, ...]):
        """(the window's S + 1 tokens, {name: its [S, ...] rows}) of the stored arrays ``names``."""
        arrays = self.reader.sample_arrays(sample, (fmt.TOKENS, *names))
        begin, end = window * self.seq_length, (window + 1) * self.seq_length
        return arrays[fmt.TOKENS][begin:end + 1], {name: torch.from_numpy(arrays[name][begin:end]) for name in names}

    def row(self, sample: int, window: int) -> KDRow:
        tokens, rows = self._window(sample, window, (fmt.IDS, fmt.LOGPROBS))
        return window_row(tokens, TopKTeacher(rows[fmt.IDS], rows[fmt.LOGPROBS]))
