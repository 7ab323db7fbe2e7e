"""A blend of several stores (sources) with weights: one split's rows drawn from each source in proportion to its
weight, in megatron-core's deterministic blending order (Megatron's ``--data-path 0.3 A 0.7 B``).

Row i of the blend is row j_i of source d_i, where (d_i, j_i) is megatron-core's blending index
(``megatron.core.datasets.helpers.build_blending_indices``, what its ``BlendedDataset`` uses): each row goes to the
source whose drawn share lags its weight most, so every prefix of the order holds the sources in proportion and
(d_i, j_i) depends on the weights and i alone. Source d's rows are a ``rows.KDRows`` over its cached samples (its
epochs, each in its own order computed row by row from (seed, epoch): ``window_order``), so row i is a pure function
of (the blend, seed, i): a run resumed at ``consumed_samples`` continues on exactly the rows it would have seen,
under any DP size or batch size.
Without weights each source weighs its rows per epoch (Megatron's blend of sizes: one epoch of the blend is one
epoch of each source, the way stores written by separate cache jobs over disjoint data join).

Each row carries its source's index (``KDRow.source``: the index among the run's sources, for the per-source
figures). Sources of different K (top-K, top-p, other K) are padded to the largest K (``SlotTeacher.padded``: slots
with no support, as top-p rows already hold). What may blend is checked once, before step one (``check_blend``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from megatron_kd_plugin.cache.rows.kd_rows import KDRow, KDRows, RowKind, rows_ahead
from megatron_kd_plugin.cache.rows.rank_rows import RankRows, RowsAhead


def check_blend(kinds: Mapping[str, RowKind]) -> None:
    """ValueError (one line naming the stores) unless the rows of ``kinds`` ({name: kind}) can be read side by side
    by one loss: one type of teacher (a sampled store's tails are not a top-K's), K slots per token that can be
    padded, and one tokenizer. (Each kind has checked its own store: finished, vocabulary, seq_length.)"""
    if len(kinds) < 2:
        return
    unblendable = [name for name, kind in kinds.items() if kind.teacher_type is None]
    if unblendable:
        raise ValueError(f"{unblendable[0]} gives rows of another tokenizer (dataset.student_tokenizer), which "
                         "read one store: blend stores read with the teacher's tokenizer")
    types = {}
    for name, kind in kinds.items():
        types.setdefault(kind.teacher_type.__name__, []).append(name)
    if len(types) > 1:
        described = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in types.items())
        raise ValueError(f"stores of different kinds of teacher rows cannot blend ({described}): their tails differ "
                         "(a sampled store's draws need kd.tail='sampled', a top-K store a top-K tail); blend stores "
                         "of one kind")
    tokenizers = {}
    for name, kind in kinds.items():
        tokenizers.setdefault(kind.reader.spec.tokenizer, []).append(name)
    if len(tokenizers) > 1:
        described = "; ".join(f"{tokenizer!r}: {', '.join(names)}" for tokenizer, names in tokenizers.items())
        raise ValueError(f"the blended stores were cached with different tokenizers ({described}); a student reads "
                         "the token ids of one tokenizer")


def blend_weights(weights: Sequence[float] | None, sizes: Sequence[int]) -> np.ndarray:
    """The normalised weights (float64, summing to 1) of a blend of sources holding ``sizes`` rows per epoch; None:
    in proportion to the sizes."""
    chosen = np.asarray(sizes if weights is None else weights, dtype=np.float64)
    if chosen.shape != (len(sizes),) or (chosen < 0).any() or not chosen.sum() > 0:
        raise ValueError(f"blend weights {list(chosen)}: expected one weight >= 0 per source, not all 0")
    return chosen / chosen.sum()


class BlendedRows(torch.utils.data.Dataset):
    """``num_rows`` rows of a weighted blend of sources (module docstring).

    ``sources``: (kind, cached sample ids, source index) per source; ``weights``: one per source (normalised here;
    None: in proportion to the sources' rows per epoch); ``seed``/``shuffle``/``reads``/``read_ahead`` as ``KDRows``
    (the blend's rows this process reads: their samples are hinted to each source's store)."""

    def __init__(self, sources: Sequence[tuple[RowKind, np.ndarray, int]], weights: Sequence[float] | None, *,
                 num_rows: int, seed: int, shuffle: bool = True, reads: RankRows | None = None,
                 read_ahead: bool = True):
        from megatron.core.datasets import helpers

        if len(sources) < 2:
            raise ValueError(f"a blend of {len(sources)} source(s): use the source's KDRows")
        if len(sources) >= 2**15:
            raise ValueError(f"a blend of {len(sources)} sources: megatron-core's blending index holds < 32768")
        sizes = [len(ids) * kind.rows_per_sample() for kind, ids, _ in sources]
        self.weights = blend_weights(weights, sizes)
        self.num_rows = num_rows
        self.dataset_index = np.zeros(num_rows, dtype=np.int16)           # [num_rows] d_i
        self.dataset_row = np.zeros(num_rows, dtype=np.int64)             # [num_rows] j_i
        helpers.build_blending_indices(self.dataset_index, self.dataset_row, self.weights, len(sources), num_rows,
                                       False)
        counts = np.bincount(self.dataset_index, minlength=len(sources))
        self.parts = [KDRows(kind, ids, num_rows=int(count), seed=seed, shuffle=shuffle, source=source,
                             read_ahead=False) for (kind, ids, source), count in zip(sources, counts)]
        self.slots = max(kind.slots() for kind, _, _ in sources)
        reads = RankRows(num_rows=num_rows) if reads is None else reads
        self._ahead = RowsAhead(reads, rows_ahead(max(kind.seq_length for kind, _, _ in sources)),
                                self.hint_rows) if read_ahead else None

    def __len__(self) -> int:
        return self.num_rows

    def source_of(self, row: int) -> tuple[int, int]:
        """(position of the source in this blend, its row) that row ``row`` reads."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range for a blend of {self.num_rows} rows")
        return int(self.dataset_index[row]), int(self.dataset_row[row])

    def hint_rows(self, rows) -> None:
        """The rows to be read next, in order: each source hears of its own."""
        parts = [[] for _ in self.parts]
        for row in rows:
            parts[self.dataset_index[row]].append(int(self.dataset_row[row]))
        for part, part_rows in zip(self.parts, parts):
            if part_rows:
                part.hint_rows(part_rows)

    def __getitem__(self, row: int) -> KDRow:
        if self._ahead is not None:
            self._ahead(int(row))
        part, part_row = self.source_of(int(row))
        item = self.parts[part][part_row]
        if item.teacher.ids.shape[-1] < self.slots:
            item = item._replace(teacher=item.teacher.padded(self.slots))
        return item
