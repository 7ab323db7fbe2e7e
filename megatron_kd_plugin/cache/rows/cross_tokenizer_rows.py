"""Cross-tokenizer rows: a student whose tokenizer differs from the teacher's, reading a store written with
``cache --cross-tokenizer``.

Besides the top-K (or draws), such a store holds each token's realised log-prob and the teacher tokenizer's byte
table (``format.py``, ``token_bytes.py``). Each cached sample gives one row: its text re-tokenised by the student,
aligned to the teacher's tokens and cut at a segment boundary to seq_length (``align.py``), whose teacher is a
``CrossTokenizerTeacher``: each position's ALM segment, each segment's teacher log-likelihood, and, from a top-K
store, the token-level term's slots (the teacher's candidates read as the student's next token: ``token_slots.py``,
``first_tokens.py``). Each sample's alignment is computed once per store and student tokenizer
(``student_alignments.py``: in a memory-mapped sidecar beside the store, written by the first process to take its
lock, before step one). Its loss is ``loss.cross_tokenizer_loss``.
"""

from __future__ import annotations

import warnings

from megatron_kd_plugin.cache.rows.kd_rows import KDRow, RowKind
from megatron_kd_plugin.cache.cross_tokenizer.student_alignments import StudentAlignments, load_or_write, sidecar_path
from megatron_kd_plugin.loss import KDLossOptions
from megatron_kd_plugin.loss.cross_tokenizer_loss import check_options


class CrossTokenizerRows(RowKind):
    """One row per cached sample for a student with its own tokenizer (module docstring)."""

    def __init__(self, reader, **kwargs):
        super().__init__(reader, **kwargs)
        if reader.spec.documents:
            raise ValueError(f"{reader.path} holds {reader.spec.layout} rows and a student with its own tokenizer "
                             "(dataset.student_tokenizer) re-tokenises each sample as one text; cache the store with "
                             "--layout stream")
        if self.alignments_source not in ("sidecar", "memory"):
            raise ValueError(f"student alignments from {self.alignments_source!r}: expected 'sidecar' or 'memory'")
        self.alignments = StudentAlignments(reader, self.student)   # refuses a store without the byte table

    @classmethod
    def serves(cls, spec, student) -> bool:
        return student is not None

    def validate(self, *, vocab_size: int | None = None, k: int | None = None) -> None:
        self.reader.validate(k=k)
        if vocab_size is not None and len(self.student.strings) > vocab_size:
            raise ValueError(f"the student's tokenizer has {len(self.student.strings)} ids, more than the student's "
                             f"vocab_size={vocab_size}")

    def check(self, options: KDLossOptions, *, context_parallel_size: int = 1, heal: bool = False) -> list[str]:
        if context_parallel_size > 1:
            raise ValueError(f"model.context_parallel_size={context_parallel_size} with a cross-tokenizer student "
                             "(dataset.student_tokenizer): segments would be split across CP ranks; use 1")
        check_options(options)
        if options.token_weight > 0 and not self.reader.spec.kind.exact_slots:
            raise ValueError(f"kd.token_weight={options.token_weight} needs the teacher's top-K, and "
                             f"{self.reader.path} is a {self.reader.spec.kind.name} store; write it without --draws")
        return []

    def rows_per_sample(self) -> int:
        return 1

    def row(self, sample: int, window: int) -> KDRow:
        return self.alignments.row(sample, self.seq_length)

    def prepare(self) -> None:
        """``sidecar``: map the store's alignments from their sidecar, computing and writing it first if absent or
        of another store/tokenizer (where the folder is read-only: computed on first use and kept in memory, with
        a warning); ``memory``: nothing now (each sample aligned on first read)."""
        if self.alignments_source != "sidecar":
            return
        path = sidecar_path(self.reader, self.student)
        try:
            load_or_write(self.alignments, path)
        except OSError as error:                 # a read-only folder or file system
            warnings.warn(f"{path}: not written ({error}); the student alignments are computed on first use and "
                          "kept in memory", stacklevel=2)
