"""The ``document`` layout: one document per row of ``S + 1`` token slots, padded after it (the padding its own
run of positions, loss mask 0). A document longer than a row is refused in one line unless splitting is asked for;
then each piece (``planned_rows.py``) is a row of its own."""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.layouts.planned_rows import PlannedRows
from megatron_kd_plugin.cache.layouts.row_input import RowInput


def one_per_row(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Piece i in row i. Shape: lengths int64 [P] -> int64 [P]."""
    del capacity
    return np.arange(len(lengths), dtype=np.int64)


class DocumentLayout:
    """One document (or, split, one piece) per row."""

    name = "document"
    several_documents = True                # the document and the padding after it, its own run of positions

    def rows(self, source: RowInput, seq_length: int, *, num_samples: int | None) -> PlannedRows:
        return PlannedRows(source.documents(self.name), seq_length, layout=self.name, place=one_per_row,
                           split=source.split_documents, num_samples=num_samples)
