"""The ``packed`` layout: whole documents packed into rows of ``S + 1`` token slots without crossing one another
(positions restart and the teacher attends within each document), a document longer than a row split into
pieces (``planned_rows.py``), padding only at a row's end.

Placement is best-fit decreasing: the pieces, longest first (ties in data order), each into the row whose free
slots fit it most tightly (the most recently filled of equal ones), else a new row: first-fit decreasing's bound
(at most 11/9 of the fewest rows, plus one) with tighter rows left open for the short pieces, and deterministic; rows are then numbered by their first piece and hold their pieces in
data order, so the first rows hold the first documents. O(P log S) for P pieces.
"""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.layouts.planned_rows import PlannedRows
from megatron_kd_plugin.cache.layouts.row_input import RowInput


class _FreeSlots:
    """A multiset of free-slot counts 0..capacity (one per open row) as a segment tree of counts: add, remove, and
    the smallest count >= m, each O(log capacity)."""

    def __init__(self, capacity: int):
        self.size = 1 << (capacity + 1).bit_length()
        self.tree = [0] * (2 * self.size)

    def add(self, value: int, count: int = 1) -> None:
        node = value + self.size
        while node:
            self.tree[node] += count
            node >>= 1

    def smallest_at_least(self, value: int) -> int:
        """The smallest member >= ``value``, -1 if none."""
        tree, node = self.tree, value + self.size
        if node >= 2 * self.size:
            return -1
        if tree[node]:
            return value
        while node > 1:
            if not node & 1 and tree[node + 1]:          # the right sibling: the next larger values
                node += 1
                while node < self.size:
                    node = 2 * node if tree[2 * node] else 2 * node + 1
                return node - self.size
            node >>= 1
        return -1


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each piece (module docstring). Shape: lengths int64 [P], each <= capacity -> int64 [P]."""
    free, rows_with = _FreeSlots(capacity), {}                # rows_with[f]: the open rows with f free slots
    row_of = np.empty(len(lengths), dtype=np.int64)
    opened = 0
    for piece in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[piece])
        fit = free.smallest_at_least(length)
        if fit < 0:
            row, fit, opened = opened, capacity, opened + 1
        else:
            row = rows_with[fit].pop()
            free.add(fit, -1)
        row_of[piece] = row
        if fit - length >= 2:                                  # a piece with a label has two tokens or more
            rows_with.setdefault(fit - length, []).append(row)
            free.add(fit - length)
    first_piece = np.full(opened, len(lengths), dtype=np.int64)
    np.minimum.at(first_piece, row_of, np.arange(len(lengths), dtype=np.int64))
    number = np.empty(opened, dtype=np.int64)
    number[np.argsort(first_piece, kind="stable")] = np.arange(opened, dtype=np.int64)
    return number[row_of]


class PackedLayout:
    """Documents packed into rows (module docstring); longer documents always split."""

    name = "packed"
    several_documents = True

    def rows(self, source: RowInput, seq_length: int, *, num_samples: int | None) -> PlannedRows:
        if source.split_documents:
            raise ValueError("splitting documents applies to the 'document' layout: a packed row always splits a "
                             "document longer than itself")
        return PlannedRows(source.documents(self.name), seq_length, layout=self.name, place=best_fit_decreasing,
                           split=True, num_samples=num_samples)
