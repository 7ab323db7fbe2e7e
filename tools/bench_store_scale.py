"""Store bookkeeping at the sizes users cache (issue #37): what grows with the store, side by side in one run.

    python tools/bench_store_scale.py                       # every section, at the sizes of the issue
    python tools/bench_store_scale.py --sections writer restart --sizes 1e7 1e10

Sections (each prints one table; ratios against the smallest size or against one process):

``layout``  the default shard size against smaller and larger ones at S = 4096, K = 100 (``grid8``): files per 10^6
            tokens, the largest folder at 10^11 tokens, what a writer holds per shard (its arrays' bytes), the tokens
            a kill loses per writer, and the measured write rate of one shard of synthetic rows (``writer.store_shard``
            on the real format).
``writer``  the real writer (``write_cache``, a table teacher of 64 ids, K = 4: the shard's own work is small, so its
            bookkeeping shows) writing the last shards of stores of 10^7 ... 10^11 tokens (S = 4096, 16 samples a
            shard: the issue's setting, the most shards per token) as the last of as many data-parallel ranks as
            leave it 8 shards, three rounds over the sizes in alternating order: the fastest shard at each size,
            ratio to 10^7 (torch on one thread: a busy second core stalls its parallel loops).
``restart`` a skeleton store (its metadata and an empty file for every shard file, all shards written; the default
            shard size) at each size: the resume checks of ``writer.prepare_shards`` over all shards by one process,
            then by two processes at once (each its half, as two data-parallel ranks do); ratio two / one. Also the
            files and the largest folder of the skeleton.
``verify``  ``inspect --verify`` of a real store of synthetic rows (``--verify-tokens``, K = 100) with one process and
            with two; ratio two / one (the two include the processes' start, ~2 s of imports each).
``reader``  a reader's memory: RSS after reading one sample of each of the first 10^2 shards of a store of
            ``--reader-shards`` one-sample shards (S = 64, K = 8), then after one sample of each of them all.
``shuffle`` the memory of the training rows' order: ``KDRows.window_of`` over a split of 10^11 / 512 windows
            (tracemalloc peak while reading rows of the first and the last epoch positions).

Every figure is measured here, on this machine; say the load next to it (``uptime``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import torch
import zarr

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.sources.token_windows import SourceSummary, TokenWindows
from megatron_kd_plugin.cache.writer import prepare_shards, store_shard, write_cache

S, K, V = 4096, 100, 151_936


def synthetic_rows(spec: fmt.CacheSpec, begin: int, end: int, seed: int) -> dict[str, np.ndarray]:
    """The arrays of samples [begin, end) of a top-K store of ``spec``: random ids sorted per row, log-probs of a
    random distribution over them with 0.9 of the mass."""
    rng = np.random.default_rng([seed, begin])
    n = end - begin
    ids = np.sort(rng.integers(0, spec.vocab_size, (n, spec.seq_length, spec.k), dtype=np.int32), axis=-1)
    weights = rng.random((n, spec.seq_length, spec.k), dtype=np.float32) + 0.01
    logprobs = np.log(0.9 * weights / weights.sum(-1, keepdims=True))
    tokens = rng.integers(0, spec.vocab_size, (n, spec.seq_length + 1), dtype=np.int32)
    return {fmt.TOKENS: tokens, fmt.IDS: ids, fmt.LOGPROBS: logprobs.astype(spec.logprob_dtype)}


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))


def files_in(path: pathlib.Path) -> tuple[int, int]:
    """(files and folders below ``path``, the most entries of one folder)."""
    count, largest = 0, 0
    for _, dirs, files in os.walk(path):
        count += len(dirs) + len(files)
        largest = max(largest, len(dirs) + len(files))
    return count, largest


# -- layout ---------------------------------------------------------------------------------------------------


def layout(work: pathlib.Path) -> None:
    rows = []
    for shard_tokens in (1 << 16, 1 << 18, 1 << 20):
        p = shard_tokens // S
        spec = fmt.CacheSpec(k=K, vocab_size=V, seq_length=S, num_samples=p, samples_per_shard=p)
        store = work / f"layout_{p}"
        fmt.create_store(store, spec)
        arrays = synthetic_rows(spec, 0, p, seed=0)
        begin = time.perf_counter()
        store_shard(zarr.open_group(store, mode="r+"), spec, 0, arrays)
        seconds = time.perf_counter() - begin
        held = sum(values.nbytes for values in arrays.values())
        shards_1e11 = -(-int(1e11) // shard_tokens)
        files_per_shard = len(fmt.sample_arrays(spec))           # the per-sample arrays and chunk_records
        rows.append([f"{shard_tokens:,} ({p})", f"{files_per_shard * 1e6 / shard_tokens:.1f}", f"{shards_1e11:,}",
                     f"{held / 2**20:,.0f}", f"{shard_tokens:,}", f"{shard_tokens / seconds / 1e6:.2f}",
                     "default" if shard_tokens == fmt.SHARD_TOKENS else ""])
        shutil.rmtree(store)
    table(f"layout: shard size at S={S}, K={K}, grid8 (format {fmt.FORMAT_VERSION})",
          ["tokens a shard (samples)", "files / 1e6 tokens", "largest folder at 1e11", "writer holds (MiB)",
           "a kill loses (tokens)", "write (M tokens/s)", ""], rows)


# -- writer ---------------------------------------------------------------------------------------------------


class HashedTokens:
    """A token stream of ``length`` ids that exists only as a function of the position (a skeleton's data)."""

    def __init__(self, length: int, vocab: int):
        self.length, self.vocab = length, vocab

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        return (np.asarray(index, dtype=np.int64) * 2654435761) % self.vocab


def writer(work: pathlib.Path, sizes: list[float]) -> None:
    vocab, k, per_shard, shards = 64, 4, 16, 8
    table_logits = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))

    def logits_fn(tokens, position_ids=None):                               # [b, s] -> [s, b, V]
        return table_logits[tokens].transpose(0, 1)

    fastest: dict[float, list[float]] = {size: [] for size in sizes}
    for order in (sizes, sizes[::-1], sizes):            # three rounds, alternating order: the best of each
        for size in order:
            samples = int(size) // S
            num_shards = -(-samples // per_shard)
            source = TokenWindows(HashedTokens(samples * S + 1, vocab), S, num_samples=samples,
                                  fingerprint="skeleton", tokenizer="hashed", tokenizer_vocab_size=None)
            source.summary = SourceSummary("skeleton", 0, vocab - 1)   # a skeleton's content is not scanned
            dp_size = num_shards // shards
            times: list[float] = []
            store = work / f"writer_{size:.0e}"
            try:
                write_cache(source, logits_fn, store, k=k, vocab_size=vocab, teacher="table",
                            samples_per_shard=per_shard, dp_rank=dp_size - 1, dp_size=dp_size, progress=False,
                            on_shard_written=lambda n: times.append(time.perf_counter()))
            except ValueError as exc:                    # the other ranks' shards are not written
                assert "cannot finish" in str(exc), exc
            fastest[size].append(float(np.min(np.diff(times)[:-1])))   # the store's last shard may be partial
            shutil.rmtree(store)
    rows, base = [], None
    for size in sizes:
        per = min(fastest[size])                         # the fastest shard: what load cannot inflate
        base = base or per
        rows.append([f"{size:.0e}", f"{-(-(int(size) // S) // per_shard):,}", f"{shards - 1} x 3",
                     f"{per:.3f}", f"{per / base:.2f}"])
    table(f"writer: seconds per shard of the real writer (S={S}, {per_shard} samples a shard, K={k}, V={vocab}, "
          "a table teacher), the last shards of the store", ["store tokens", "shards", "shards timed",
                                                             "s / shard (fastest)", "ratio to first"], rows)


# -- restart ---------------------------------------------------------------------------------------------------


def skeleton(path: pathlib.Path, tokens: float) -> fmt.CacheSpec:
    """The metadata of a store of ``tokens`` tokens and an empty file for every shard file: every shard written."""
    spec = fmt.CacheSpec(k=K, vocab_size=V, seq_length=S, num_samples=int(tokens) // S)
    if not (path / "zarr.json").is_file():
        fmt.create_store(path, spec)
        group = zarr.open_group(path, mode="r")
        files = fmt.ShardFiles(path, group, spec)
        for name in files.arrays:
            for shard in range(spec.num_shards):
                pathlib.Path(files.file(name, shard)).touch()
    return spec


def _prepare(path: str, spec: fmt.CacheSpec, shards: range, start, queue) -> None:
    start.wait()
    begin = time.perf_counter()
    prepare_shards(pathlib.Path(path), spec, shards, repair=False)
    queue.put(time.perf_counter() - begin)


def _timed_prepare(path: pathlib.Path, spec: fmt.CacheSpec, processes: int) -> float:
    """Wall seconds of ``prepare_shards`` over all shards split among ``processes`` started at once."""
    context = multiprocessing.get_context("spawn")
    start, queue = context.Barrier(processes), context.Queue()
    per, extra = divmod(spec.num_shards, processes)
    workers = []
    for rank in range(processes):
        begin = rank * per + min(rank, extra)
        workers.append(context.Process(target=_prepare, args=(str(path), spec, range(begin, begin + per + (
            rank < extra)), start, queue)))
        workers[-1].start()
    seconds = max(queue.get() for _ in workers)
    for worker in workers:
        worker.join()
    return seconds


def restart(work: pathlib.Path, sizes: list[float]) -> None:
    rows = []
    for size in sizes:
        path = work / f"skeleton_{size:.0e}"
        begin = time.perf_counter()
        spec = skeleton(path, size)
        made = time.perf_counter() - begin
        count, largest = files_in(path)
        one = min(_timed_prepare(path, spec, 1) for _ in range(2))
        two = min(_timed_prepare(path, spec, 2) for _ in range(2))
        rows.append([f"{size:.0e}", f"{spec.num_shards:,}", f"{count:,}", f"{count / size * 1e6:.2f}", f"{largest:,}",
                     f"{one:.3f}", f"{two:.3f}", f"{two / one:.2f}", f"{made:.0f}"])
    table(f"restart: resume checks of a skeleton store (S={S}, {fmt.default_samples_per_shard(S)} samples a shard, "
          "every shard written), best of 2", ["store tokens", "shards", "files+folders", "per 1e6 tokens",
                                             "largest folder", "1 process (s)", "2 processes (s)", "ratio",
                                             "skeleton made (s)"], rows)


# -- verify ----------------------------------------------------------------------------------------------------


def verify(work: pathlib.Path, tokens: float) -> None:
    per_shard = 16
    samples = int(tokens) // S
    spec = fmt.CacheSpec(k=K, vocab_size=V, seq_length=S, num_samples=samples, samples_per_shard=per_shard,
                         teacher="synthetic", fingerprint="synthetic")
    path = work / "verify"
    if not (path / "zarr.json").is_file() or zarr.open_group(path).attrs.get("num_samples") != samples:
        shutil.rmtree(path, ignore_errors=True)
        fmt.create_store(path, spec)
        group = zarr.open_group(path, mode="r+")
        rows = synthetic_rows(spec, 0, per_shard, seed=1)          # every shard the same rows (their records differ)
        for shard in range(spec.num_shards):
            begin, end = spec.shard_range(shard)
            store_shard(group, spec, shard, {name: values[:end - begin] for name, values in rows.items()})
        group.attrs.update(complete=True)
    stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    rows, seconds = [], {}
    for workers in (1, 2, 1, 2):
        begin = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "inspect", str(path), "--verify",
                               "--workers", str(workers), "--samples", "1"], capture_output=True, text=True)
        elapsed = time.perf_counter() - begin
        assert done.returncode == 0 and "verified" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
        seconds[workers] = min(seconds.get(workers, elapsed), elapsed)
    for workers in (1, 2):
        rows.append([workers, f"{seconds[workers]:.1f}", f"{samples * S / seconds[workers] / 1e6:.2f}",
                     f"{seconds[workers] / seconds[1]:.2f}"])
    table(f"verify: inspect --verify of a store of {samples * S:,} tokens ({stored / 2**30:.2f} GiB, K={K}, grid8, "
          f"{spec.num_shards} shards), the whole command, best of 2", ["processes", "seconds", "M tokens/s",
                                                                        "ratio to 1"], rows)


# -- reader ----------------------------------------------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reader(work: pathlib.Path, num_shards: int) -> None:
    from megatron_kd_plugin.cache.store.reader import TopKCacheReader
    from megatron_kd_plugin.cache.store.records import shard_records

    seq, k = 64, 8
    spec = fmt.CacheSpec(k=k, vocab_size=V, seq_length=seq, num_samples=num_shards, samples_per_shard=1,
                         teacher="synthetic", fingerprint="synthetic")
    path = work / f"reader_{num_shards}"
    if not (path / "zarr.json").is_file() or not zarr.open_group(path).attrs.get("complete"):
        shutil.rmtree(path, ignore_errors=True)
        fmt.create_store(path, spec)
        group = zarr.open_group(path, mode="r+")
        block = 4096                                     # whole blocks of shards per zarr call (zarr writes them
        for begin in range(0, num_shards, block):         # concurrently), then their records
            end = min(begin + block, num_shards)
            for name, values in synthetic_rows(spec, begin, end, seed=2).items():
                group[name][begin:end] = values
            group[fmt.RECORDS][begin:end] = np.concatenate([shard_records(path, group, spec, shard)
                                                            for shard in range(begin, end)])
        group.attrs.update(complete=True)
    store = TopKCacheReader(path)
    start = _rss_mib()
    for sample in range(100):
        store[sample]
    after_100 = _rss_mib()
    for sample in range(100, num_shards):
        store[sample]
    after_all = _rss_mib()
    table(f"reader: RSS of one process reading one sample of each shard (S={seq}, K={k}, one sample a shard)",
          ["after opening (MiB)", "after 1e2 shards", f"after {num_shards:.0e} shards", "growth 1e2 -> all (MiB)"],
          [[f"{start:.0f}", f"{after_100:.0f}", f"{after_all:.0f}", f"{after_all - after_100:.1f}"]])


# -- shuffle ---------------------------------------------------------------------------------------------------


def shuffle(tokens: float, seq_length: int) -> None:
    from megatron_kd_plugin.cache.rows.kd_rows import KDRow, KDRows, RowKind

    class Skeleton(RowKind):                             # rows of a store that is not there: one window a sample
        @classmethod
        def serves(cls, spec, student):
            return True

        def validate(self, **_):
            pass

        def check(self, options, **_):
            return []

        def rows_per_sample(self):
            return 1

        def row(self, sample, window):
            return KDRow(None, None, None, None, None)

    samples = int(tokens) // seq_length
    tracemalloc.start()
    rows = KDRows(Skeleton(None, seq_length=seq_length), range(samples), num_rows=2 * samples, seed=1234)
    picked = [rows.window_of(j) for j in list(range(1000)) + list(range(2 * samples - 1000, 2 * samples))]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(set(picked)) > 1900
    table(f"shuffle: the rows' order over {samples:,} windows (10^{np.log10(tokens):.0f} tokens, S={seq_length})",
          ["windows", "peak traced memory (MiB)"], [[f"{samples:,}", f"{peak / 2**20:.3f}"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["layout", "writer", "restart", "verify", "reader", "shuffle"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e7, 1e9, 1e10, 1e11],
                        help="store sizes in tokens (writer, restart)")
    parser.add_argument("--verify-tokens", type=float, default=2e7, help="tokens of the store --verify reads")
    parser.add_argument("--reader-shards", type=int, default=100_000, help="shards of the reader section's store")
    parser.add_argument("--work", default=None, help="folder for the stores (default: a temporary one, removed)")
    args = parser.parse_args()
    torch.set_num_threads(1)                             # a busy second core stalls torch's parallel loops
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="bench_store_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_store_scale: format version {fmt.FORMAT_VERSION}, load {os.getloadavg()[0]:.1f}, work {work}")
    try:
        for section in args.sections:
            begin = time.perf_counter()
            {"layout": lambda: layout(work), "writer": lambda: writer(work, args.sizes),
             "restart": lambda: restart(work, args.sizes), "verify": lambda: verify(work, args.verify_tokens),
             "reader": lambda: reader(work, args.reader_shards), "shuffle": lambda: shuffle(1e11, 512)}[section]()
            print(f"({section}: {time.perf_counter() - begin:.0f} s, load {os.getloadavg()[0]:.1f}, max RSS "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB)")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
