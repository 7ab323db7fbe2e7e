"""The kinds of teacher rows, looked up for a store and a student: the one place that decides which kind a run
reads (``kd_rows.RowKind``)."""

from __future__ import annotations

from megatron_kd_plugin.cache.rows.cross_tokenizer_rows import CrossTokenizerRows
from megatron_kd_plugin.cache.rows.kd_rows import RowKind
from megatron_kd_plugin.cache.rows.slot_rows import SlotRows

ROW_KINDS: tuple[type[RowKind], ...] = (CrossTokenizerRows, SlotRows)
"""Every kind, the first that serves a store and student wins."""


def row_kind(reader, *, seq_length: int, student=None, alignments: str = "sidecar") -> RowKind:
    """The rows of ``reader``'s store for a student of ``seq_length`` tokens a row whose tokenizer is ``student`` (a
    ``TokenBytes``; None or the store's own tokenizer: the teacher's tokens as they are). ``alignments``: where a
    cross-tokenizer student's alignments come from (``sidecar`` or ``memory``)."""
    if student is not None and student.identity == reader.spec.tokenizer:
        student = None
    for kind in ROW_KINDS:
        if kind.serves(reader.spec, student):
            return kind(reader, seq_length=seq_length, student=student, alignments=alignments)
    raise ValueError(f"{reader.path}: no kind of row serves a {reader.spec.kind.name} store")
