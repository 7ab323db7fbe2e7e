"""``python -m megatron_kd_plugin inspect STORE [--samples N] [--plot out.png] [--verify]``: what a store holds.

Prints the attributes, completeness (and the missing samples of an unfinished store), bytes on disk per token
(total and per array; zarr temporaries a kill left are counted apart, the next run deletes them), and over up to
N written samples (evenly spaced), at the tokens the loss reads (loss mask 1: every token of a stream store), the
quantiles of the top-K mass m = Σ_k p_k and of the teacher entropy over the
K+1 buckets (the K ids plus the tail as one bucket: H = −Σ_k p_k log p_k − (1−m) log(1−m), a lower bound of the
full-vocab entropy). For a top-p store, also the number of ids kept per token (the finite slots) and the mass
they hold. For a sampled store (``mode``
shown first) the statistics are the number of distinct drawn ids per token and the teacher mass they cover.
``--plot`` draws both histograms into a PNG. ``--verify`` reads every written sample through the checking reader
(``records.py``: every CRC32C, every chunk's record, every shard file present), one process per core
(``--workers``), and names every damaged shard with its first damage. Without it, a written shard whose file is missing, or damage in the samples the statistics
read (checked the same way), is an error too; so is a store whose metadata are damaged or do not match its
attributes (``format.open_store``). Every damage error names the command that repairs it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import warnings

import numpy as np

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.chunk_reader import REPAIR
from megatron_kd_plugin.cache.store.records import SampleReader, verify_shards

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)


def stored_bytes(path) -> dict[str, int]:
    """Bytes on disk (or in the object store) per top-level entry of the store, zarr's temporaries (``*.partial``)
    left out."""
    if isinstance(path, storage.ObjectPrefix):
        sizes: dict[str, int] = {}
        for key, size in path.sizes().items():
            sizes[key.split("/")[0]] = sizes.get(key.split("/")[0], 0) + size
        return dict(sorted(sizes.items()))

    def size(entry: pathlib.Path) -> int:
        return sum(f.stat().st_size for f in entry.rglob("*") if f.is_file() and not fmt.is_partial(f)) \
            if entry.is_dir() else entry.stat().st_size
    return {child.name: size(child) for child in sorted(path.iterdir()) if not fmt.is_partial(child)}


def verify(path: pathlib.Path, group, spec: fmt.CacheSpec, written: list[int], workers: int) -> int:
    """Reads every sample of the ``written`` shards, ``workers`` processes at once (``records.verify_shards``); the
    samples read. ValueError naming every damaged shard (with its first damage) and the repair command."""
    for name in fmt.VOCAB_TABLE:
        if name in group:
            group[name][:]                     # one chunk each; zarr checks its CRC32C
    damaged = verify_shards(path, group, spec, written, workers=workers, progress=True)
    if damaged:
        listed = "\n".join(f"  shard {shard} (samples [{spec.shard_range(shard)[0]}, {spec.shard_range(shard)[1]})): "
                            f"{message}" for shard, message in sorted(damaged.items()))
        raise ValueError(f"{len(damaged)} of {len(written)} written shards of {path} are damaged:\n{listed}\n"
                         f"{REPAIR}")
    return sum(end - begin for begin, end in map(spec.shard_range, written))


def describe(path, samples: int = 256, check: bool = False,
             workers: int = 1) -> tuple[str, dict[str, np.ndarray]]:
    """(the report text, {"top-K mass": values, "entropy": values}) of the store at ``path``; ``check``: verify
    every written chunk first, ``workers`` processes at once (see :func:`verify`)."""
    path = fmt.store_location(path)
    group, spec = fmt.open_store(path)
    files = fmt.ShardFiles(path, group, spec)
    written = files.written()
    missing_files = [] if check else files.missing_files(written)   # --verify names them all
    if missing_files:
        raise ValueError(f"{path} is damaged: {len(missing_files)} files of written shards are missing "
                         f"({'; '.join(missing_files[:3])}{'; ...' if len(missing_files) > 3 else ''}); {REPAIR}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checked = SampleReader(path, group, spec)
    slots = spec.kind.describe(spec)
    lines = [f"store {path}", f"mode: {slots}", json.dumps(dict(group.attrs), indent=1, sort_keys=True)]
    lines += [f"warning: {warning.message}" for warning in caught]
    missing = files.missing_samples()
    if group.attrs.get("complete") is True:
        lines.append(f"complete: yes ({spec.num_samples} samples)")
    else:
        lines.append(f"complete: NO — samples {fmt.describe_ranges(missing)} not written (readers refuse it)")
    sizes = stored_bytes(path)
    done = spec.num_samples - sum(end - begin for begin, end in missing)
    lines.append(f"bytes on disk: {sum(sizes.values())} for {done} of {spec.num_samples} samples; "
                 f"{sum(sizes.values()) / max(1, done * spec.seq_length):.1f} bytes/token written "
                 f"({slots}, {spec.logprob_codec})")
    lines += [f"  {name:<20} {size / max(1, done * spec.seq_length):8.1f} bytes/token" for name, size in sizes.items()]
    partials = [] if isinstance(path, storage.ObjectPrefix) else [f for f in path.rglob("*") if fmt.is_partial(f)]
    if partials:
        lines.append(f"  {len(partials)} temporary files a killed run left (not counted; the next run deletes them)")
    if check:
        lines.append(f"verified: every checksum and record of the {verify(path, group, spec, written, workers)} "
                     "written samples matches")
    picked = np.concatenate([np.arange(*spec.shard_range(s)) for s in written]) if written else \
        np.zeros(0, dtype=np.int64)
    picked = picked[np.linspace(0, len(picked) - 1, min(samples, len(picked))).round().astype(int)] \
        if len(picked) else picked
    stats: dict[str, np.ndarray] = {}
    if len(picked):
        rows = [checked.read(int(i)) for i in picked]
        read = np.stack([row[fmt.LOSS_MASK] for row in rows]) == 1 if fmt.LOSS_MASK in rows[0] else \
            np.ones((len(rows), spec.seq_length), dtype=bool)   # [n, S]: the tokens the loss reads
        stats = spec.kind.statistics(np.stack([row[fmt.IDS] for row in rows])[read],
                                     np.stack([row[fmt.LOGPROBS] for row in rows])[read])
        header = "  ".join(f"q{int(q * 100):>3}" for q in QUANTILES)
        lines.append(f"over {len(picked)} samples ({int(read.sum())} tokens the loss reads):   {header}")
        for name, values in stats.items():
            row = "  ".join(f"{v:4.3f}" if values.dtype.kind == "f" else f"{v:5.0f}"
                            for v in np.quantile(values, QUANTILES, method="lower" if values.dtype.kind != "f"
                                                 else "linear"))
            lines.append(f"  {name:<28} {row}   mean {values.mean():.4f}")
    return "\n".join(lines), stats


def plot(stats: dict[str, np.ndarray], output) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(stats), figsize=(5 * len(stats), 3.6))
    for ax, (name, values) in zip(np.atleast_1d(axes), stats.items()):
        ax.hist(values, bins=50)
        ax.set_xlabel(name)
        ax.set_ylabel("tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_kd_plugin inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="path of the cache store (a folder, s3://BUCKET/PREFIX or msc://PROFILE/PATH)")
    parser.add_argument("--samples", type=int, default=256, help="samples to compute the statistics over")
    parser.add_argument("--plot", default=None, help="write top-K mass and entropy histograms to this PNG")
    parser.add_argument("--verify", action="store_true", help="read every written chunk and check its checksums")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes that --verify reads with (default: one per core)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers={args.workers}: expected >= 1")
    try:
        text, stats = describe(args.store, args.samples, check=args.verify, workers=args.workers)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}")
        return 2
    print(text)
    if args.plot:
        if not stats:
            print("error: nothing written yet, nothing to plot")
            return 2
        plot(stats, args.plot)
        print(f"plot: {args.plot}")
    return 0
