"""Slot rows: what a student with the teacher's tokenizer reads from a store of any kind whose rows are K slots per
token (``kinds/``: top-K, top-p, sampled, head + draws).

The store holds, per cached sample of S_c tokens, the tokens [S_c + 1] and each token's K slots [S_c, K]: ids and
their teacher log-probs, plus what the kind adds (``format.py``). A student of seq_length S (S divides S_c) reads
S_c / S windows per sample; window w of sample i is the row

    tokens  = cache.tokens[i][w*S : w*S + S]      labels = cache.tokens[i][w*S + 1 : w*S + S + 1]
    teacher = kind.teacher(the window's stored slots [S, K])   # loss.TopKTeacher, or loss.SampledTeacher with the
                                                                # slots' importance weights (kinds.StoreKind.weights)

in the store's dtypes (int32 ids; the decoded log-probs), loss_mask 1, position_ids 0..S-1. A documents store
(layout ``packed`` or ``document``) is read whole, S = S_c (a window would cut its documents: ``reader.validate``
refuses another S), with the store's own loss mask and positions (``loss_mask`` as float32, ``position_ids`` as
int64), whose restarts are the row's documents (``megatron_kd_plugin.documents``). Its loss is the top-K loss
(``loss.topk_kd_loss``) with a tail the kind serves (``kinds.StoreKind.check_tail``).
"""

from __future__ import annotations

import torch

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.rows.kd_rows import KDRow, RowKind, window_row
from megatron_kd_plugin.loss import KDLossOptions
from megatron_kd_plugin.loss.options import check_training_options


class SlotRows(RowKind):
    """Windows of a store for a student with the teacher's tokenizer (module docstring)."""

    def __init__(self, reader, **kwargs):
        super().__init__(reader, **kwargs)
        self.store_kind = reader.spec.kind
        self.teacher_type = self.store_kind.teacher_type
        self.names = (fmt.IDS, fmt.LOGPROBS) + self.store_kind.token_arrays(reader.spec)
        self.row_masks = (fmt.LOSS_MASK, fmt.POSITION_IDS) if reader.spec.documents else ()   # stream: none stored
        reader.validate(seq_length=self.seq_length)

    @classmethod
    def serves(cls, spec, student) -> bool:
        return student is None

    def validate(self, *, vocab_size: int | None = None, k: int | None = None) -> None:
        self.reader.validate(vocab_size=vocab_size, seq_length=self.seq_length, k=k)
        try:
            fmt.check_logprob_codec(self.store_kind, self.reader.spec.logprob_codec)
        except ValueError as error:
            raise ValueError(f"{self.reader.path} was written with the {error}; rewrite the store with the same cache "
                             "command and --overwrite") from None

    def check(self, options: KDLossOptions, *, context_parallel_size: int = 1, heal: bool = False) -> list[str]:
        self.store_kind.check_tail(options, str(self.reader.path))
        if options.token_weight > 0:
            raise ValueError(f"kd.token_weight={options.token_weight} is for a student with its own tokenizer: set "
                             "dataset.student_tokenizer to the student's tokenizer, or kd.token_weight=0")
        return check_training_options(options, heal=heal)

    def rows_per_sample(self) -> int:
        return self.reader.spec.seq_length // self.seq_length

    def row(self, sample: int, window: int) -> KDRow:
        arrays = self.reader.sample_arrays(sample, (fmt.TOKENS, *self.names, *self.row_masks))
        begin, end = window * self.seq_length, (window + 1) * self.seq_length
        # a copy: the arrays are the chunk cache's read-only buffers, shared with the next reads of the sample
        rows = {name: torch.from_numpy(arrays[name][begin:end].copy()) for name in self.names}
        return window_row(arrays[fmt.TOKENS][begin:end + 1], self.store_kind.teacher(self.reader.spec, rows),
                          *(arrays[name][begin:end] for name in self.row_masks))
