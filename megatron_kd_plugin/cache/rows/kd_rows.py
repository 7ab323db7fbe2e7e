"""Student training rows read from a store: the typed row, the protocol every kind of teacher row follows, and the
map-style dataset Megatron's samplers index.

A kind of row (``slot_rows``: any store read with the teacher's tokenizer; ``cross_tokenizer_rows``; ``row_kinds`` looks
one up for a store and a student) says in one place what the store holds for it (``serves``), how a row is read
(``row``: a ``KDRow`` whose ``teacher`` is the kind's typed teacher, which picks the loss:
``megatron_kd_plugin.loss.step``) and what it needs of the run (``check``). Nothing else tests which kind a store or a
row is.

Rows are windows of a split's cached samples visited epoch after epoch, each epoch in its own order, a keyed
bijection of the epoch's windows computed row by row from (seed, epoch) (``window_order.WindowOrder``: O(1) memory,
no array of the epoch's windows): row j is a pure function of (seed, j), so a run resumed at ``consumed_samples`` by
Megatron's samplers continues on exactly the rows it would have seen, and any DP size / batch size reads the same
sequence.
Each row carries the index of its store among the run's (``KDRow.source``): a blend of stores (``blended_rows``)
reports each store's figures apart.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import numpy as np
import torch

from megatron_kd_plugin.cache.rows.rank_rows import RankRows, RowsAhead
from megatron_kd_plugin.cache.rows.window_order import WindowOrder
from megatron_kd_plugin.loss import KDLossOptions, RowTeacher


class KDRow(NamedTuple):
    """One student row, as a dataset yields it ([S] per token) and a DataLoader batches it ([b, S]); a field a
    pipeline stage does not use may be None (``bridge.forward_step.get_kd_batch``)."""

    tokens: torch.Tensor | None         # [S] int64 input ids
    labels: torch.Tensor | None         # [S] int64 the token each position predicts
    loss_mask: torch.Tensor | None      # [S] float32 token weights, 0 = not counted
    position_ids: torch.Tensor | None   # [S] int64
    teacher: RowTeacher | None          # the kind's typed teacher ([S, ...] tensors)
    source: torch.Tensor | None = None  # [] int64 (batched: [b]) the row's source, its index among the run's stores
    #                                     (``KDRows`` sets it; a blend's per-source figures: ``blended_rows``)


def window_row(tokens: np.ndarray, teacher, loss_mask: np.ndarray | None = None,
               position_ids: np.ndarray | None = None) -> KDRow:
    """The row of a window of S + 1 cached tokens [S + 1] and its teacher ([S, ...]): labels are the tokens shifted
    by one; ``loss_mask`` [S] (a documents store's uint8) and ``position_ids`` [S] (its int32) as stored, None: every
    position counted and positions 0..S-1 (a stream store's window)."""
    tokens = torch.from_numpy(np.array(tokens, dtype=np.int64))       # a copy: the chunk cache's buffers are read-only
    seq_length = len(tokens) - 1
    loss_mask = (torch.ones(seq_length, dtype=torch.float32) if loss_mask is None
                 else torch.from_numpy(loss_mask.astype(np.float32)))
    position_ids = (torch.arange(seq_length, dtype=torch.long) if position_ids is None
                    else torch.from_numpy(position_ids.astype(np.int64)))
    return KDRow(tokens[:-1], tokens[1:], loss_mask, position_ids, teacher)


class RowKind(abc.ABC):
    """One kind of teacher row of an open store (``reader``, a ``TopKCacheReader``) for a student of ``seq_length``
    tokens a row. ``student`` (a ``TokenBytes`` of another identity than the store's tokenizer, or None) and
    ``alignments`` (where its alignments come from: ``sidecar`` or ``memory``) are the student's tokenizer; only
    the kind that serves another tokenizer reads them."""

    teacher_type: type | None = None
    """The type of its rows' teacher when they can blend with other stores' (``blended_rows``): K slots per token
    (``loss.TopKTeacher``, ``loss.SampledTeacher``), padded to a common K; None: rows that read one store."""

    def __init__(self, reader, *, seq_length: int, student=None, alignments: str = "sidecar"):
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length}: expected >= 1")
        self.reader, self.seq_length = reader, seq_length
        self.student, self.alignments_source = student, alignments

    @classmethod
    @abc.abstractmethod
    def serves(cls, spec, student) -> bool:
        """Whether rows of a store of ``spec`` (a ``CacheSpec``) for a student whose tokenizer is ``student`` (a
        ``TokenBytes`` of another identity than the store's, or None: the store's own tokenizer) are of this kind."""

    @abc.abstractmethod
    def validate(self, *, vocab_size: int | None = None, k: int | None = None) -> None:
        """ValueError unless the store fits the student: its ids within ``vocab_size``, its K equal to ``k``
        (None: not checked)."""

    @abc.abstractmethod
    def check(self, options: KDLossOptions, *, context_parallel_size: int = 1, heal: bool = False) -> list[str]:
        """ValueError, in one line naming the setting to change, for loss options or parallelism these rows cannot
        serve; the warnings to show before step one (``heal``: the student starts from trained weights)."""

    @abc.abstractmethod
    def rows_per_sample(self) -> int:
        """Student rows per cached sample."""

    @property
    def documents(self) -> bool:
        """Whether its rows may hold several documents (a store of layout ``packed`` or ``document``), which attend
        only within themselves (``megatron_kd_plugin.documents``)."""
        return self.reader.spec.documents

    def num_samples(self) -> int:
        """Cached samples its rows read (sample ids 0 .. num_samples - 1)."""
        return self.reader.spec.num_samples

    def slots(self) -> int:
        """Teacher slots per token of its rows (K), for kinds with a ``teacher_type``."""
        return self.reader.spec.k

    @abc.abstractmethod
    def row(self, sample: int, window: int) -> KDRow:
        """Row ``window`` of cached sample ``sample``."""

    def prepare(self) -> None:
        """Work due once before step one (default: none)."""

    def hint(self, samples) -> None:
        """The cached samples its next rows read, in order (the reader fetches them ahead on object storage)."""
        self.reader.hint(samples)


READ_AHEAD_TOKENS = 1 << 17
"""Tokens of rows whose samples a dataset hints ahead of the one asked for (``read_ahead.py``): 256 rows at S = 512,
~25 MB of a K = 100 store."""


def rows_ahead(seq_length: int) -> int:
    """Rows a dataset of ``seq_length``-token rows hints ahead (:data:`READ_AHEAD_TOKENS`)."""
    return max(16, READ_AHEAD_TOKENS // seq_length)


class KDRows(torch.utils.data.Dataset):
    """``num_rows`` rows of ``kind`` drawn from the cached samples ``sample_ids`` (module docstring), each marked as
    coming from source ``source`` (``KDRow.source``). ``sample_ids``: a ``range`` (kept as it is: nothing per sample,
    as nothing per window) or any sequence of ids. ``reads``: the rows this process reads, in order (a
    ``rank_rows.RankRows``: its data-parallel rank's share; None: every row), whose samples are hinted to the store
    ahead (object storage: ``read_ahead.py``) unless ``read_ahead`` is False (a blend's sources: the blend hints)."""

    def __init__(self, kind: RowKind, sample_ids: range | np.ndarray, *, num_rows: int, seed: int,
                 shuffle: bool = True, source: int = 0, reads: RankRows | None = None, read_ahead: bool = True):
        if len(sample_ids) == 0:
            raise ValueError("this split holds no cached samples; change the split or write a larger cache")
        self.kind = kind
        self.sample_ids = sample_ids if isinstance(sample_ids, range) else np.asarray(sample_ids, dtype=np.int64)
        self.windows_per_sample = kind.rows_per_sample()
        self.windows_per_epoch = len(self.sample_ids) * self.windows_per_sample
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.source = torch.tensor(source, dtype=torch.int64)
        self._order = None   # the WindowOrder of the last epoch read (a few round keys)
        reads = RankRows(num_rows=num_rows) if reads is None else reads
        self._ahead = RowsAhead(reads, rows_ahead(kind.seq_length), self.hint_rows) if read_ahead else None

    def __len__(self) -> int:
        return self.num_rows

    def window_of(self, row: int) -> tuple[int, int]:
        """(cached sample index, window index) that row ``row`` reads."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range for a dataset of {self.num_rows} rows")
        epoch, position = divmod(row, self.windows_per_epoch)
        window = position
        if self.shuffle:
            if self._order is None or self._order.epoch != epoch:
                self._order = WindowOrder(self.windows_per_epoch, seed=self.seed, epoch=epoch)
            window = self._order(position)
        sample, offset = divmod(window, self.windows_per_sample)
        return int(self.sample_ids[sample]), offset

    def __getitem__(self, row: int) -> KDRow:
        if self._ahead is not None:
            self._ahead(int(row))
        return self.kind.row(*self.window_of(int(row)))._replace(source=self.source)

    def hint_rows(self, rows) -> None:
        """The rows to be read next, in order: their samples are hinted to the kind."""
        self.kind.hint([self.window_of(row)[0] for row in rows])
