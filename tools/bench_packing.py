"""How fast the ``packed`` layout plans its rows, and how full they are, from 10^4 to 10^6 documents.

    python tools/bench_packing.py [--documents 10000 100000 1000000] [--seq-lengths 4096 32768]

Documents of log-normal lengths (median 400 tokens, sigma 1.2: mostly short conversations, a tail of long files;
mean ~800), every token a loss target, ids all 1 (placement reads only lengths, so the ids cost no memory). For
each document count and S, one ``PlannedRows`` (the cache command's packed rows: pieces, best-fit decreasing,
row offsets) and then every row's tokens, masks and positions built block by block as the writer asks for them.
Prints one table: plan seconds, documents/s, efficiency (loss-target tokens / row slots) against the bound of a
perfect packing (total tokens / whole rows), and row building in M tokens/s.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megatron_kd_plugin.cache.layouts.packed_layout import best_fit_decreasing  # noqa: E402
from megatron_kd_plugin.cache.layouts.planned_rows import PlannedRows  # noqa: E402
from megatron_kd_plugin.cache.sources import DocumentMasks, DocumentSet  # noqa: E402


def documents(count: int, seed: int = 0) -> DocumentSet:
    """``count`` documents of log-normal lengths (module docstring), backed by constant arrays."""
    lengths = np.clip(np.random.default_rng(seed).lognormal(np.log(400), 1.2, count), 2, None).astype(np.int64)
    total = int(lengths.sum())
    return DocumentSet(kind="text", tokens=np.broadcast_to(np.int32(1), (total,)),
                       offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                       targets=np.broadcast_to(np.uint8(1), (total,)), appended=None, eod_id=0,
                       masks=DocumentMasks(), content=lambda: f"bench lengths seed={seed}", tokenizer="bench",
                       tokenizer_vocab_size=2, name="bench documents")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--block-rows", type=int, default=64, help="rows built at a time (the writer's shard)")
    args = parser.parse_args(argv)
    print("| documents | S | tokens | rows | plan s | documents/s | efficiency | perfect bound | rows M tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count in args.documents:
        source = documents(count)
        for s in args.seq_lengths:
            start = time.perf_counter()
            rows = PlannedRows(source, s, layout="packed", place=best_fit_decreasing, split=True, num_samples=None)
            plan = time.perf_counter() - start
            start = time.perf_counter()
            for begin in range(0, len(rows), args.block_rows):
                rows.windows(begin, min(begin + args.block_rows, len(rows)))
                rows.row_masks(begin, min(begin + args.block_rows, len(rows)))
            build = time.perf_counter() - start
            total = int(rows.piece_lengths.sum())
            bound = total / (-(-total // (s + 1)) * (s + 1))
            print(f"| {count:,} | {s:,} | {total:,} | {len(rows):,} | {plan:.2f} | {count / plan:,.0f} | "
                  f"{rows.packing['efficiency']:.2%} | {bound:.2%} | {len(rows) * (s + 1) / build / 1e6:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
