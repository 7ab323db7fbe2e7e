"""Which rows of a dataset one reader asks for, in order, so that the read-ahead on object storage fetches the rows
this data-parallel rank trains on and no other rank's.

Megatron's sequential sampler (dataloader_type ``single``: ``megatron.bridge.data.samplers.MegatronPretrainingSampler``)
cuts the rows into global micro-batches of ``m * dp`` rows from ``consumed_samples`` on (a multiple of the global
batch, so of ``m * dp``) and gives rank ``r`` rows ``[r * m, (r + 1) * m)`` of each; with ``drop_last`` (Bridge's
default) a last incomplete global micro-batch is not read. So rank ``r``'s ``i``-th row is

    row(i) = (i // m) * m * dp + r * m + i % m,

a pure function of (r, dp, m, i), whatever the run resumes at. :class:`RankRows` is that order (one rank of one:
every row ascending); :class:`RowsAhead` hints the samples of the next rows of it to the store as they are asked for.
(Stores on object storage are read by the training process itself, ``dataset.num_workers=0``: no DataLoader worker
splits a rank's rows further.)
"""

from __future__ import annotations

from collections.abc import Callable


class RankRows:
    """The rows of a ``num_rows``-row dataset that data-parallel rank ``rank`` of ``size`` reads with micro-batches of
    ``micro_batch`` rows (module docstring). ``drop_last``: the sampler leaves out a last incomplete global
    micro-batch."""

    def __init__(self, rank: int = 0, size: int = 1, micro_batch: int = 1, *, num_rows: int,
                 drop_last: bool = True):
        if not 0 <= rank < size or micro_batch < 1:
            raise ValueError(f"RankRows(rank={rank}, size={size}, micro_batch={micro_batch}): expected "
                             "0 <= rank < size and micro_batch >= 1")
        self.rank, self.size, self.micro_batch = rank, size, micro_batch
        self.num_rows, self.drop_last = num_rows, drop_last
        self.global_batch = micro_batch * size
        self.end = num_rows - num_rows % self.global_batch if drop_last else num_rows
        """Rows at or past ``end`` are never read."""

    def __repr__(self) -> str:
        return (f"RankRows(rank={self.rank}, size={self.size}, micro_batch={self.micro_batch}, "
                f"num_rows={self.num_rows})")

    def local_index(self, row: int) -> int | None:
        """``i`` with ``row(i) == row`` (the module docstring's ``row``), or None when another rank reads ``row``."""
        batch, offset = divmod(row, self.global_batch)
        offset -= self.rank * self.micro_batch
        if not 0 <= offset < self.micro_batch:
            return None
        return batch * self.micro_batch + offset

    def global_row(self, index: int) -> int:
        """The row that is this rank's ``index``-th."""
        batch, offset = divmod(index, self.micro_batch)
        return batch * self.global_batch + self.rank * self.micro_batch + offset

    def following(self, row: int, count: int) -> list[int]:
        """``row`` and the rows this rank reads after it, ``count`` at most (fewer at the end); [] when ``row`` is
        another rank's or past the end."""
        index = self.local_index(row)
        if index is None:
            return []
        rows = (self.global_row(i) for i in range(index, index + count))
        return [found for found in rows if found < self.end]


class RowsAhead:
    """Hints ``hint(rows)`` the rows a reader of ``schedule`` (a :class:`RankRows`) reads next, ``ahead`` rows
    beyond the one asked for, half of them at a time; a row not among those hinted (a resumed run, a jump) starts
    over from it."""

    def __init__(self, schedule: RankRows, ahead: int, hint: Callable[[list[int]], None]):
        self.schedule, self.ahead, self.hint = schedule, max(2, ahead), hint
        self._position: dict[int, int] = {}   # hinted row -> its place in the reader's order
        self._last: int | None = None          # the last row hinted
        self._count = 0                        # rows hinted since the last start

    def __call__(self, row: int) -> None:
        """``row`` is asked for now."""
        place = self._position.pop(row, None)
        if place is None:
            self._position.clear()
            self._last, self._count, place = None, 0, 0
            self._extend(self.schedule.following(row, self.ahead))
        elif self._count - place <= self.ahead // 2 and self._last is not None:
            self._extend(self.schedule.following(self._last, self.ahead // 2 + 1)[1:])

    def _extend(self, rows: list[int]) -> None:
        if not rows:
            return
        for row in rows:
            self._position[row] = self._count
            self._count += 1
        self._last = rows[-1]
        self.hint(rows)
