"""The epoch order of the training rows (``cache.rows.window_order.WindowOrder``, used by ``cache.KDRows``): a bijection
of [0, n) for every n and key, a pure function of (n, seed, epoch, position), another order per epoch and seed, orders
that look like uniformly random permutations (statistics that the identity, rotations, affine maps and weak mixers
fail), and no memory of size n in the dataset.

Measured (issue #37; ``window_of`` of ``KDRows``, 8 windows a sample, 3 × 200,000 consecutive rows mid-epoch, best
pass, Python 3.12, a shared 2-core machine at load average 3-8): the permutation drawn per epoch read a row in
0.55-0.68 us once drawn, but drawing it took 28-36 ms and 8 MB at n = 10^6 windows, 6.5 s and 0.8 GB at n = 10^8
(two epochs' arrays at an epoch's turn: 1.5 GB; at 10^9, extrapolated, ~65 s and 8-16 GB: not run here); the
computed order reads 162,000-173,000 rows/s (5.8-6.2 us a row) at n = 10^6 and 154,000-166,000 rows/s (6.0-6.5 us)
at n = 10^9, and an epoch's turn costs 12 us; tracemalloc's peak over window_of calls is 0 MB at n = 10^10. A row's
read from a store costs ~870 us (docs/benchmarks.md: ~590,000 tokens per CPU-second at 512 tokens a row): the order adds
< 1 %.
"""

from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest

from megatron_kd_plugin.cache.rows.kd_rows import KDRows, RowKind
from megatron_kd_plugin.cache.rows.window_order import WindowOrder

SIZES = [*range(1, 70), *(2**k for k in range(7, 17)), *(2**k + 1 for k in range(7, 17)), 99_991]   # 99,991: prime
KEYS = [(0, 0), (0, 7), (1, 0), (2**40 + 3, 2)]                                                        # (seed, epoch)
Z_BOUND = 6.0
"""A chi-square statistic passes below its mean plus 6 standard deviations (the keys are fixed, so a passing order
passes every time; a uniformly random permutation exceeds it with probability ~1e-9)."""


class StubKind(RowKind):
    """A kind of row whose rows are never read: ``KDRows`` only asks it for its windows per sample."""

    def __init__(self, windows_per_sample: int):
        self.windows_per_sample, self.seq_length = windows_per_sample, 1

    @classmethod
    def serves(cls, spec, student) -> bool:
        return False

    def validate(self, *, vocab_size=None, k=None) -> None:
        pass

    def check(self, options, *, context_parallel_size=1, heal=False) -> list[str]:
        return []

    def rows_per_sample(self) -> int:
        return self.windows_per_sample

    def row(self, sample, window):
        raise AssertionError("not read here")


def z_score(statistic: float, df: int) -> float:
    """A chi-square statistic of ``df`` degrees of freedom in standard deviations above its mean."""
    return (statistic - df) / math.sqrt(2 * df)


def order_statistics(orders: np.ndarray, bins: int = 10) -> tuple[float, float]:
    """Two chi-square z-scores of K orders ``orders`` [K, n] (row k: the window read at each position) against
    uniformly random permutations: (where each window is read: its position's bin, per window over the K orders;
    how far apart the windows of consecutive positions are: (window(p + 1) - window(p)) mod n, uniform over 1 .. n - 1,
    binned, per order). The first fails a fixed order (the identity), the second rotations, affine maps and any
    order in which consecutive positions read windows at a few distances."""
    k, n = orders.shape
    positions = np.empty_like(orders)                                            # [K, n] the position of window w
    np.put_along_axis(positions, orders, np.broadcast_to(np.arange(n), (k, n)), axis=1)
    landed = np.zeros((n, bins))                                                 # [n, bins]
    np.add.at(landed, (np.broadcast_to(np.arange(n), (k, n)), positions * bins // n), 1)
    expected = k * np.bincount(np.arange(n) * bins // n, minlength=bins) / n
    where = z_score(((landed - expected) ** 2 / expected).sum(), n * (bins - 1))
    steps = np.diff(orders, axis=1) % n * bins // n                             # [K, n - 1]
    counts = np.stack([np.bincount(row, minlength=bins) for row in steps])       # [K, bins]
    expected = np.bincount(np.arange(1, n) * bins // n, minlength=bins)
    apart = z_score(((counts - expected) ** 2 / expected).sum(), k * (bins - 1))
    return where, apart


def test_every_order_is_a_bijection_and_one_position_at_a_time_equals_the_array():
    for n, (seed, epoch) in itertools.product(SIZES, KEYS):
        order = WindowOrder(n, seed=seed, epoch=epoch)
        windows = order.windows(np.arange(n))
        assert windows.dtype == np.int64 and np.array_equal(np.sort(windows), np.arange(n)), (n, seed, epoch)
        probe = range(n) if n < 70 else np.random.default_rng(n).integers(0, n, 20).tolist()
        assert [order(p) for p in probe] == windows[list(probe)].tolist()
    for n in (10**10, 2**62 + 12_345, 2**63):    # wide halves: Python ints and numpy's wrapping uint64 agree
        order = WindowOrder(n, seed=5, epoch=1)
        probe = np.random.default_rng(0).integers(0, n, 50, dtype=np.int64)
        windows = order.windows(probe)
        assert [order(int(p)) for p in probe] == [order(p) for p in probe] == windows.tolist()   # np.int64 too
        assert (windows >= 0).all()
        assert windows.max() < n and len(set(windows.tolist())) == len(probe)


def test_orders_are_deterministic_and_differ_between_epochs_and_seeds():
    n = 1000
    base = WindowOrder(n, seed=3, epoch=4).windows(np.arange(n))
    assert np.array_equal(WindowOrder(n, seed=3, epoch=4).windows(np.arange(n)), base)
    others = [WindowOrder(n, seed=s, epoch=e).windows(np.arange(n)) for s, e in ((3, 5), (3, 0), (4, 4), (0, 0))]
    for other in others:
        assert (other != base).mean() > 0.95          # unrelated orders, not a shifted or slightly changed one
    assert WindowOrder(1, seed=3, epoch=4)(0) == 0
    assert len({tuple(WindowOrder(3, seed=s, epoch=0).windows(np.arange(3))) for s in range(40)}) == 6


def test_small_orders_are_uniform_over_all_permutations():
    """For n = 2 .. 5 each of the n! orders comes about equally often over many seeds (the identity alone: a z-score
    of ~1e3 or more). Checked beyond: n = 6 over 72,000 seeds, z = -1.9; with 16 half-rounds instead of 32 at
    b = 3, z = 6.3 (``window_order``'s docstring)."""
    for n, per_order in ((2, 100), (3, 50), (4, 25), (5, 10)):
        orders = math.factorial(n)
        seen = {}
        for seed in range(per_order * orders):
            order = WindowOrder(n, seed=seed, epoch=1)
            key = tuple(order(p) for p in range(n))
            seen[key] = seen.get(key, 0) + 1
        assert set(seen) == set(itertools.permutations(range(n)))
        chi = sum((count - per_order) ** 2 / per_order for count in seen.values())
        assert z_score(chi, orders - 1) < Z_BOUND, (n, chi)


def test_orders_look_uniformly_random_and_broken_orders_fail_the_same_check():
    """n = 1000 over 300 seeds: where each window is read and how far apart consecutive reads are match a uniformly
    random permutation (numpy's permutations score about 0); fixed, rotated and affine orders fail.

    Deliberately broken mixers, checked by patching ``window_order`` (z-scores of (where, apart), bound 6): the round
    function without SplitMix's mix (M(z) = z: every half-round linear) (1.6, 22,588); M(z) = one product by an odd
    constant (2.8, 7,825); one Feistel round (2 half-rounds) (2.3, 163); the order as shipped (12): (-0.3, -0.3).
    (Two Feistel rounds already pass these two statistics: (0.8, 2.6).)"""
    n, seeds = 1000, range(300)
    orders = np.stack([WindowOrder(n, seed=seed, epoch=5).windows(np.arange(n)) for seed in seeds])
    where, apart = order_statistics(orders)
    assert where < Z_BOUND and apart < Z_BOUND, (where, apart)
    positions = np.arange(n)
    broken = {
        "identity": np.stack([positions for _ in seeds]),
        "rotation by the seed": np.stack([(positions + 7919 * seed) % n for seed in seeds]),
        "affine, a = 3, 9, 21, ...": np.stack([(positions * (6 * seed + 3) + seed) % n if math.gcd(6 * seed + 3, n) == 1
                                               else (positions * 7 + seed) % n for seed in seeds]),
    }
    for name, bad in broken.items():
        assert np.array_equal(np.sort(bad, axis=1), np.broadcast_to(positions, bad.shape)), name   # permutations
        assert max(order_statistics(bad)) > 100 * Z_BOUND, name


def rows(dataset: KDRows, begin: int, end: int) -> list[tuple[int, int]]:
    return [dataset.window_of(row) for row in range(begin, end)]


def test_rows_cover_each_window_once_per_epoch_without_neighbours_and_resume_mid_epoch():
    """``KDRows`` over 1,250 samples of 8 windows: every epoch reads every window once, in another order; consecutive
    rows read the same sample about as rarely as in a random order (7 / 9,999 of the pairs: ~14 in 2 epochs; reading
    in order: 87.5 %); a dataset built afresh at a row mid-epoch (a resumed run) reads what the first one reads."""
    samples, per_sample = 1250, 8
    n = samples * per_sample
    ids = np.arange(100, 100 + samples)
    dataset = KDRows(StubKind(per_sample), ids, num_rows=2 * n + 5, seed=11)
    first = rows(dataset, 0, 2 * n + 5)
    every = sorted((int(s), w) for s in ids for w in range(per_sample))
    assert sorted(first[:n]) == sorted(first[n:2 * n]) == every and first[:n] != first[n:2 * n]
    same_sample = sum(a[0] == b[0] for a, b in itertools.pairwise(first))
    assert same_sample < 40, same_sample
    for row in (n // 2 + 3, n + 17, 2 * n + 1):
        assert rows(KDRows(StubKind(per_sample), ids, num_rows=2 * n + 5, seed=11), row, row + 3) == first[row:row + 3]
    assert rows(KDRows(StubKind(per_sample), ids, num_rows=2 * n + 5, seed=12), 0, 50) != first[:50]
    unshuffled = KDRows(StubKind(per_sample), ids, num_rows=n + 2, seed=11, shuffle=False)
    assert rows(unshuffled, n - 1, n + 2) == [(int(ids[-1]), per_sample - 1), (int(ids[0]), 0), (int(ids[0]), 1)]
    with pytest.raises(IndexError):
        dataset.window_of(2 * n + 5)


def test_the_order_of_an_epoch_of_ten_billion_windows_allocates_nothing_of_its_size():
    """windows_per_epoch = 10^10 (10^6 samples of 10^4 windows): the old permutation would be 80 GB; the dataset of
    a ``range`` of samples holds nothing per sample either."""
    tracemalloc.start()
    try:
        dataset = KDRows(StubKind(10_000), range(10**6), num_rows=3 * 10**10, seed=1)
        read = [dataset.window_of(row) for row in (0, 1, 5 * 10**9, 10**10 - 1, 10**10, 2 * 10**10 + 7)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    assert all(0 <= sample < 10**6 and 0 <= window < 10_000 for sample, window in read)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n=0"):
        WindowOrder(0, seed=0, epoch=0)
    with pytest.raises(ValueError, match="seed=-1"):
        WindowOrder(5, seed=-1, epoch=0)
    order = WindowOrder(5, seed=0, epoch=0)
    with pytest.raises(IndexError, match="position 5"):
        order(5)
    with pytest.raises(IndexError):
        order.windows(np.array([0, -1]))
