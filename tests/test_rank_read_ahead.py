"""Each data-parallel rank's read-ahead hints the rows Megatron's sequential sampler gives that rank, in the order it
reads them, and no other rank's: checked against Bridge's own ``MegatronPretrainingSampler`` at DP 1/2/4, for one
store, a blend, and the provider under a real DP = 2 megatron-core parallel state."""

from __future__ import annotations

import pytest
from megatron.bridge.data.samplers import MegatronPretrainingSampler

from megatron_kd_plugin.cache import BlendedRows, KDRows, TopKCacheReader, row_kind
from megatron_kd_plugin.cache.rows.rank_rows import RankRows, RowsAhead
from tests.distributed import run_on_ranks
from tests.test_bridge_data import SEQ, datasets, kd_config, store  # noqa: F401 (the module's store fixture)

NUM_ROWS = 50


def dealt(rank: int, size: int, micro_batch: int, *, consumed: int = 0, drop_last: bool = True,
          num_rows: int = NUM_ROWS) -> list[int]:
    """The rows Bridge's sequential sampler gives ``rank``, in order."""
    sampler = MegatronPretrainingSampler(num_rows, consumed, micro_batch, rank, size, drop_last)
    return [row for batch in sampler for row in batch]


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_rank_rows_are_the_rows_megatrons_sampler_gives_each_rank(size, micro_batch, drop_last):
    for consumed in (0, 2 * micro_batch * size):          # a fresh run, and one resumed after two steps
        owners = {}
        for rank in range(size):
            expected = dealt(rank, size, micro_batch, consumed=consumed, drop_last=drop_last)
            schedule = RankRows(rank, size, micro_batch, num_rows=NUM_ROWS, drop_last=drop_last)
            assert schedule.following(expected[0], NUM_ROWS) == expected
            assert [schedule.global_row(schedule.local_index(row)) for row in expected] == expected
            for row in range(consumed, NUM_ROWS):
                if schedule.local_index(row) is not None and row < schedule.end:
                    owners.setdefault(row, []).append(rank)
        every = {row for rank in range(size) for row in dealt(rank, size, micro_batch, consumed=consumed,
                                                                drop_last=drop_last)}
        assert set(owners) == every and all(len(ranks) == 1 for ranks in owners.values())


def test_read_ahead_hints_a_ranks_own_rows_in_order_before_each_is_read():
    ahead, hinted = 8, []
    for rank in range(2):
        hinted.clear()
        order = dealt(rank, 2, 3)
        read_ahead = RowsAhead(RankRows(rank, 2, 3, num_rows=NUM_ROWS), ahead, hinted.extend)
        for count, row in enumerate(order):
            read_ahead(row)
            assert hinted == order[:len(hinted)] and len(hinted) > count     # own rows, in order, this one too
            assert len(hinted) <= count + 1 + ahead                           # never more than `ahead` beyond
        assert hinted == order
    hinted.clear()
    resumed = dealt(1, 2, 3, consumed=12)                 # a jump (a resumed run) starts over from the row asked for
    read_ahead(resumed[0])
    assert hinted == resumed[:ahead]


class HintedSamples:
    """A store's row kind whose hints are recorded (what the reader would fetch ahead)."""

    def __init__(self, path):
        self.kind = row_kind(TopKCacheReader(path), seq_length=SEQ)
        self.hinted = []
        self.kind.hint = self.hinted.extend


def test_a_store_and_a_blend_hint_only_the_samples_of_the_ranks_rows(store):  # noqa: F811
    rows = 96
    for rank in range(4):
        one = HintedSamples(store)
        dataset = KDRows(one.kind, range(12), num_rows=rows, seed=3, reads=RankRows(rank, 4, 2, num_rows=rows))
        order = dealt(rank, 4, 2, num_rows=rows)
        for row in order:
            dataset[row]
        assert one.hinted == [dataset.window_of(row)[0] for row in order]

        first, second = HintedSamples(store), HintedSamples(store)
        blend = BlendedRows([(first.kind, range(6), 0), (second.kind, range(6, 12), 1)], [0.3, 0.7], num_rows=rows,
                            seed=3, reads=RankRows(rank, 4, 2, num_rows=rows))
        for row in order:
            blend[row]
        for part, hints in enumerate((first.hinted, second.hinted)):
            own = [blend.source_of(row)[1] for row in order if blend.source_of(row)[0] == part]
            assert hints == [blend.parts[part].window_of(row)[0] for row in own]


def provider_reads(path: str) -> tuple:
    cfg = kd_config(path, "train.micro_batch_size=2", "train.global_batch_size=8")
    from megatron_kd_plugin.bridge.config import share_micro_batch_sizes

    share_micro_batch_sizes(cfg)
    train, _, _ = datasets(cfg)
    schedule = train._ahead.schedule
    return schedule.rank, schedule.size, schedule.micro_batch, schedule.num_rows


def test_the_provider_gives_each_data_parallel_rank_its_own_rows(store):  # noqa: F811
    assert run_on_ranks(2, provider_reads, str(store), tp=1, timeout=120) == [(0, 2, 2, 40), (1, 2, 2, 40)]
