"""What each data-parallel rank fetches from a store on object storage, and how fast it reads, at DP = 1, 2 and 4
ranks reading one store at once from one S3 server started here (SeaweedFS's ``weed``, ``tests/s3_server.py``).

One store is written to ``s3://`` (a table teacher, S = 512, K = 100); then, for each DP size, DP processes start
together, each reading the rows Bridge's sequential sampler (``MegatronPretrainingSampler``) gives its rank through
``cache.KDRows`` (every chunk checked), ``--rows`` rows per rank, three ways:

  on demand    no read-ahead: each sample fetched when its row is asked for (the bytes of the rows it trains on)
  every row    the read-ahead hints every row of the dataset in order (what each rank did before ``rank_rows.py``)
  own rows     the read-ahead hints the rows of its own rank (``rank_rows.RankRows``)

and prints, per DP size and way, the bytes fetched per rank as a ratio to on demand (goal: own rows <= 1.1) and the
reader tokens/s per rank (own rows at DP = 4 / DP = 1: goal >= 0.8). Bytes are what the store's client returned
(``storage.ObjectPrefix``'s range, tail and whole-object reads, counted in each process).

    python tools/bench_rank_reads.py [--samples 512] [--rows 256] [--micro-batch 2]

Run nothing else heavy beside it (the server and the readers share the CPUs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.s3_server import LocalS3  # noqa: E402

SEQ, K, VOCAB = 512, 100, 4096
URL = "s3://bench/ranks/topk.zarr"
WAYS = ("on demand", "every row", "own rows")


def write_store(samples: int) -> None:
    import torch

    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.writer import write_cache

    table = 4 * torch.randn(1024, VOCAB, generator=torch.Generator().manual_seed(0))
    stream = np.random.default_rng(1).integers(0, VOCAB, samples * SEQ + 1)
    source = TokenWindows(stream, SEQ, num_samples=samples, fingerprint="bench-ranks", tokenizer="bench",
                          tokenizer_vocab_size=VOCAB)
    write_cache(source, lambda tokens, position_ids=None: table[tokens % 1024].transpose(0, 1), URL, k=K, vocab_size=VOCAB,
                teacher="bench", samples_per_shard=max(1, samples // 16), micro_batch_size=4, progress=False)


def count_fetched_bytes() -> list[int]:
    """Counts the bytes every ``ObjectPrefix`` read returns in this process, into the returned one-item list."""
    from megatron_kd_plugin.cache.store import storage

    fetched = [0]
    ranges, tail, get = storage.ObjectPrefix.ranges, storage.ObjectPrefix.tail, storage.ObjectPrefix.get

    def counted_ranges(self, key, spans):
        parts = ranges(self, key, spans)
        fetched[0] += sum(map(len, parts))
        return parts

    def counted_tail(self, key, nbytes):
        data, size = tail(self, key, nbytes)
        fetched[0] += len(data)
        return data, size

    def counted_get(self, key):
        data = get(self, key)
        fetched[0] += len(data)
        return data

    storage.ObjectPrefix.ranges, storage.ObjectPrefix.tail, storage.ObjectPrefix.get = \
        counted_ranges, counted_tail, counted_get
    return fetched


def read_rank(rank: int, size: int, way: str, rows_per_rank: int, micro_batch: int, env: dict, start, results):
    """One rank's read: its sampler's rows through KDRows; puts (rank, bytes fetched, rows, seconds)."""
    os.environ.update(env)
    from megatron.bridge.data.samplers import MegatronPretrainingSampler

    from megatron_kd_plugin.cache import KDRows, TopKCacheReader, row_kind
    from megatron_kd_plugin.cache.rows.rank_rows import RankRows

    fetched = count_fetched_bytes()
    reader = TopKCacheReader(URL)
    num_rows = rows_per_rank * size
    reads = RankRows(rank, size, micro_batch, num_rows=num_rows) if way == "own rows" else None
    dataset = KDRows(row_kind(reader, seq_length=SEQ), range(len(reader)), num_rows=num_rows, seed=0, reads=reads,
                     read_ahead=way != "on demand")
    order = [row for batch in MegatronPretrainingSampler(num_rows, 0, micro_batch, rank, size) for row in batch]
    opened = fetched[0]
    start.wait()
    begin = time.perf_counter()
    for row in order:
        dataset[row]
    seconds = time.perf_counter() - begin
    results.put((rank, fetched[0] - opened, len(order), seconds))


def run(size: int, way: str, args, env: dict) -> list[tuple]:
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(size), ctx.Queue()
    procs = [ctx.Process(target=read_rank, args=(rank, size, way, args.rows, args.micro_batch, env, start, results))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    found = sorted(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512, help="samples of the store (S = 512 tokens each)")
    parser.add_argument("--rows", type=int, default=256, help="rows each rank reads")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--sizes", default="1,2,4", help="DP sizes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_rank_reads.") as tmp:
        server = LocalS3.start(pathlib.Path(tmp) / "s3")
        try:
            os.environ.update(server.env())
            server.create_bucket("bench")
            write_store(args.samples)
            print(f"load average before: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
            print(f"\nstore: {args.samples} samples x S={SEQ}, K={K}, V={VOCAB}; {args.rows} rows per rank, "
                  f"micro-batch {args.micro_batch}, shuffled rows; all DP ranks read at once from one server")
            print("| DP | way | MB fetched per rank | x on demand | tokens/s per rank | tokens/s all ranks |")
            print("|---|---|---|---|---|---|")
            for size in map(int, args.sizes.split(",")):
                demand = None
                for way in WAYS:
                    found = run(size, way, args, server.env())
                    fetched = np.mean([f[1] for f in found])
                    demand = fetched if way == "on demand" else demand
                    per_rank = np.mean([f[2] * SEQ / f[3] for f in found])
                    total = sum(f[2] for f in found) * SEQ / max(f[3] for f in found)
                    print(f"| {size} | {way} | {fetched / 1e6:,.1f} | {fetched / demand:.2f} | {per_rank:,.0f} | "
                          f"{total:,.0f} |", flush=True)
            print(f"load average after: {os.getloadavg()[0]:.2f}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
