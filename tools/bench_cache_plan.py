"""``plan --cache`` against the cache command's measured peak memory on CPU, as ratios (issue #50, item 3).

    python tools/bench_cache_plan.py            # the three cases below, one fresh process each
    python tools/bench_cache_plan.py --case head

Each case makes a tiny random-init Qwen3 with ``transformers`` (``save_pretrained``, as ``tests/hf_models.py``), a
JSONL of its word tokens, and runs the real command (``commands.cache.main``, fp32, megatron-core's local attention)
in a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers leave the resident set). The peak is the
kernel's high-water mark of the resident set (``VmHWM``), reset through ``/proc/self/clear_refs`` when the store is
prepared and the teacher built (``on_shard_written(0)``); measured = peak − the RSS there, the writing's transient.
The plan's counterpart is its CPU total without the weights (they are in that baseline): max(forward, head) + the
shard buffer (``cache/cache_plan.py``); the weights are checked apart, parameters planned / ``num_parameters()``.

Cases, each with one term dominating: ``attention`` (S = 2048: local attention's [b, heads, s, s] scores and
probabilities), ``head`` (V = 65,536 under a 192 MiB head budget), ``shard`` (K = 256, 256 samples a shard). Each is
large enough that what the first write costs beside the plan (code pages, zarr's and blosc's buffers: ~10-20 MiB
measured) stays under 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

CASES = {
    # name: (model fields, cache flags)
    "attention": (dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=8, head_dim=16),
                  ["--seq-length", "2048", "--topk", "8", "--num-samples", "4", "--micro-batch-size", "2"]),
    "head": (dict(vocab_size=65536, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16),
             ["--seq-length", "256", "--topk", "16", "--num-samples", "4", "--micro-batch-size", "4",
              "--head-chunk-bytes", str(192 << 20)]),
    "shard": (dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16),
              ["--seq-length", "256", "--topk", "256", "--num-samples", "256", "--samples-per-shard", "256",
               "--micro-batch-size", "8"]),
}
"""Tiny Qwen3 shapes (2 layers, 2 KV groups) and the cache command's flags of each case."""


def make_teacher(folder: pathlib.Path, fields: dict) -> int:
    """A random-init tiny Qwen3 (fp32) and a word-level tokenizer of its whole vocabulary in ``folder``; returns
    its parameter count."""
    import torch
    import transformers

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests.hf_models import save_word_tokenizer

    config = transformers.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=4096,
                                      tie_word_embeddings=False, dtype="float32", **fields)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    save_word_tokenizer(folder, fields["vocab_size"])
    return model.num_parameters()


def write_words(path: pathlib.Path, vocab: int, tokens: int) -> None:
    """A JSONL of random words w2..w{vocab-1}, ``tokens`` of them in documents of 1,000."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(0, tokens, 1000):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(2, vocab)}" for _ in range(1000))}) + "\n")


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run_case(name: str) -> dict:
    """One case in this process: {"measured", "planned", "params", "planned_params", terms...} in bytes."""
    import torch

    from megatron_kd_plugin.cache.cache_plan import CacheLayout, plan_cache, teacher_shape
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.commands import cache
    from megatron_kd_plugin.models.hf import hf_model_provider

    torch.set_num_threads(1)
    fields, flags = CASES[name]
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"bench_cache_plan_{name}_"))
    params = make_teacher(work / "teacher", fields)
    args = cache.parse_args(["--teacher", str(work / "teacher"), "--data", str(work / "data.jsonl"),
                             "--output", str(work / "cache.zarr"), "--no-progress", *flags])
    write_words(work / "data.jsonl", fields["vocab_size"], args.num_samples * (args.seq_length + 1) + 1000)
    provider = hf_model_provider(args.teacher, load_weights=False, inference=True)
    shard = min(args.samples_per_shard or fmt.default_samples_per_shard(args.seq_length), args.num_samples)
    spec = fmt.CacheSpec(k=args.slots, vocab_size=provider.vocab_size, seq_length=args.seq_length,
                         num_samples=shard, samples_per_shard=shard)           # the one shard a case writes
    teacher = teacher_shape(provider)
    plan = plan_cache(teacher, CacheLayout(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                           spec=spec, param_bytes=4, head_chunk_bytes=args.head_chunk_bytes,
                                           attention="local"))
    baseline = {}

    def on_shard_written(shards: int) -> None:
        if shards == 0:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            baseline["rss"] = status_bytes("VmRSS")

    cache.run(args, on_shard_written=on_shard_written)
    return dict(measured=status_bytes("VmHWM") - baseline["rss"], planned=plan.cpu_total - plan.weights,
                forward=plan.forward, head=plan.head, shard=plan.shard_buffer, params=params,
                planned_params=teacher.params_per_gpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: all")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child)))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    mib = 2**20
    print(f"{'case':<10}{'forward':>10}{'head':>10}{'shard':>10}{'planned':>10}{'measured':>10}{'plan/meas':>10}"
          f"{'params plan/HF':>16}   (MiB; load)")
    for name in args.case or list(CASES):
        out = subprocess.run([sys.executable, __file__, "--child", name], env=env, check=True, capture_output=True,
                             text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        load = os.getloadavg()[0]
        print(f"{name:<10}{r['forward'] / mib:>10.1f}{r['head'] / mib:>10.1f}{r['shard'] / mib:>10.1f}"
              f"{r['planned'] / mib:>10.1f}{r['measured'] / mib:>10.1f}{r['planned'] / r['measured']:>10.3f}"
              f"{r['planned_params'] / r['params']:>16.4f}   load {load:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
