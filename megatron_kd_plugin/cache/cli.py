"""The cache tool: run a teacher over token data once and write its top-K store (``tools/cache_teacher_logits.py``).

    torchrun --nproc_per_node 2 tools/cache_teacher_logits.py --teacher TEACHER_DIR --data DATA_PREFIX \\
        --output cache.zarr --seq-length 512 --topk 100 --tp 2 --micro-batch-size 4

World = TP x DP (pipeline parallelism is not supported: ``--pp`` must be 1). The teacher is a ``save_gpt``
folder (megatron-core GPTModel), or whatever ``--teacher-loader module:function`` returns: a callable
``load(path, tp_size) -> model`` whose ``model(tokens, position_ids, attention_mask)`` gives ``[b, s, V/tp]``
logits (the hook for Megatron-Bridge/HF teachers on GPU) together with the vocab size via ``--vocab-size``.
Rerunning the same command resumes a killed run; ``--overwrite`` replaces a store written with other settings.

``--sample N`` (instead of ``--topk``) writes a sampled store (issue #8): N ids per token drawn with replacement
from q ∝ p^(1/t), t = ``--proposal-temperature`` (default 1), seeded by ``--sample-seed`` and the sample index (the
same draws at any TP/DP size and after a resume).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_kd_plugin.cache import format as fmt


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron_kd_plugin cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="teacher checkpoint folder (save_gpt) or --teacher-loader path")
    p.add_argument("--teacher-loader", default=None,
                   help="module:function(path, tp_size) -> model, instead of megatron_kd_plugin.gpt.load_gpt")
    p.add_argument("--vocab-size", type=int, default=None, help="teacher vocab size (needed with --teacher-loader)")
    p.add_argument("--data", required=True, help="Megatron indexed dataset PREFIX (.bin/.idx) or a .jsonl file")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or HF name); required for JSONL, recorded "
                   "as the tokenizer identity and checked against the teacher vocab otherwise")
    p.add_argument("--text-key", default="text", help="JSONL field holding the text")
    p.add_argument("--output", required=True, help="store path (a directory, e.g. cache.zarr)")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per sample S")
    p.add_argument("--num-samples", type=int, default=None, help="first N windows only (default: all)")
    p.add_argument("--topk", type=int, default=None, help="K of a top-K store (default 100)")
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="write a sampled store of N draws per token instead of the top-K")
    p.add_argument("--proposal-temperature", type=float, default=None,
                   help="t of the sampled store's proposal q ~ p^(1/t) (default 1; only with --sample)")
    p.add_argument("--sample-seed", type=int, default=None, help="seed of the draws (default 0; only with --sample)")
    p.add_argument("--temperature", type=float, default=1.0, help="cache temperature")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (world size must be a multiple)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (only 1 is supported)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per teacher forward")
    p.add_argument("--samples-per-shard", type=int, default=16, help="samples per shard (resume unit)")
    p.add_argument("--logprob-codec", default=fmt.DEFAULT_LOGPROB_CODEC, choices=sorted(fmt.LOGPROB_CODECS))
    p.add_argument("--store-logsumexp", action="store_true", help="also store the teacher's full-vocab LSE")
    p.add_argument("--overwrite", action="store_true", help="replace a store written with other settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.sample is None:
        extra = [flag for flag, value in (("--proposal-temperature", args.proposal_temperature),
                                          ("--sample-seed", args.sample_seed)) if value is not None]
        if extra:
            p.error(f"{' and '.join(extra)} only apply to a sampled store: add --sample N")
        args.mode, args.slots = "topk", 100 if args.topk is None else args.topk
    else:
        if args.topk is not None:
            p.error("--topk and --sample exclude each other: a store holds the top-K or N draws per token")
        args.mode, args.slots = "sampled", args.sample
    for flag, value in (("--topk", args.topk), ("--sample", args.sample)):
        if value is not None and value < 1:
            p.error(f"{flag}={value}: expected >= 1")
    if args.proposal_temperature is not None and not args.proposal_temperature > 0:
        p.error(f"--proposal-temperature={args.proposal_temperature}: expected > 0")
    return args


def init_distributed(tp: int, pp: int) -> None:
    """Process group from torchrun's environment (a single process without it), then megatron parallel_state."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds

    if pp != 1:
        raise ValueError(f"--pp={pp}: pipeline parallelism is not supported by the cache tool; use --tp and DP")
    if "RANK" not in os.environ:             # a plain single process, not under torchrun
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    apply_cpu_workarounds()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    if dist.get_world_size() % tp:
        raise ValueError(f"--tp={tp} does not divide the world size {dist.get_world_size()}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def load_teacher(args):
    """(model, vocab_size, identity) of the teacher."""
    from megatron_kd_plugin.gpt import checkpoint_identity, load_gpt

    identity = checkpoint_identity(args.teacher) if pathlib.Path(args.teacher).is_dir() else args.teacher
    if args.teacher_loader:
        module, _, function = args.teacher_loader.partition(":")
        if args.vocab_size is None:
            raise ValueError("--teacher-loader needs --vocab-size")
        model = getattr(importlib.import_module(module), function)(args.teacher, args.tp)
        return model, args.vocab_size, identity
    model, spec = load_gpt(args.teacher, tp_size=args.tp)
    if args.seq_length > spec.seq_length:
        raise ValueError(f"--seq-length={args.seq_length} exceeds the teacher's seq_length={spec.seq_length}")
    return model, spec.vocab_size, identity


def run(args) -> None:
    from megatron.core import parallel_state

    from megatron_kd_plugin.cache.sources import open_source
    from megatron_kd_plugin.cache.writer import write_cache
    from megatron_kd_plugin.gpt import gpt_logits

    init_distributed(args.tp, args.pp)
    model, vocab_size, identity = load_teacher(args)
    model.eval()
    source = open_source(args.data, args.seq_length, tokenizer=args.tokenizer, num_samples=args.num_samples,
                         text_key=args.text_key)
    stats = write_cache(
        source, lambda tokens: gpt_logits(model, tokens), args.output, k=args.slots, vocab_size=vocab_size,
        teacher=identity, temperature=args.temperature, logprob_codec=args.logprob_codec,
        samples_per_shard=args.samples_per_shard, store_logsumexp=args.store_logsumexp,
        micro_batch_size=args.micro_batch_size, mode=args.mode,
        proposal_temperature=1.0 if args.proposal_temperature is None else args.proposal_temperature,
        sample_seed=args.sample_seed or 0, overwrite=args.overwrite,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_rank=parallel_state.get_data_parallel_rank(), dp_size=parallel_state.get_data_parallel_world_size(),
        progress=not args.no_progress)
    if dist.get_rank() == 0:
        stored = sum(f.stat().st_size for f in pathlib.Path(args.output).rglob("*") if f.is_file())
        tokens = len(source) * source.seq_length
        slots = f"K={args.slots}" if args.mode == "topk" else f"sampled N={args.slots}"
        print(f"[cache] {args.output}: {len(source)} samples x {source.seq_length} tokens, {slots}, "
              f"{stored / tokens:.1f} bytes/token on disk", flush=True)
        if stats.tokens:
            print(f"[cache] rank 0 computed {stats.tokens} tokens in {stats.total_seconds:.2f} s "
                  f"({stats.tokens / stats.total_seconds:.0f} tokens/s); teacher forward {stats.forward_seconds:.2f}"
                  f" s; overhead (total / plain forward) {stats.overhead:.3f}x", flush=True)
        else:
            print(f"[cache] nothing to do: all {stats.shards_skipped} shards of rank 0 were already written",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
