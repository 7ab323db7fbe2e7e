"""Log-prob codec study (issue #21): bytes/token and round-trip KL of candidate codecs on real trained teachers.

    python tools/bench_codec.py prepare --output /tmp/codec_teachers [--hf-teacher DIR --hf-data PREFIX]
    python tools/bench_codec.py study --teachers /tmp/codec_teachers [--k 16 50 100] [--synthetic 32768 201088]

``prepare`` trains (or loads) the teachers once and saves each one's float64 top-100 (ids and log-probs in rank
order, normalised over the full vocabulary) with its tokens to ``OUTPUT/NAME.npz``, so the study never retrains:

- ``confident``: ``tools/bench_quality.py``'s confident teacher (the ``small`` preset of the from-scratch demo: BPE
  vocab 512, a 2 x 128 megatron-core GPT trained 1,200 steps);
- ``uncertain``: its uncertain teacher (the same with ``--vocab-size 2048 --teacher-steps 300``);
- ``hf_qwen3``: the heal demo's trained Hugging Face Qwen3 teacher (``megatron_kd_plugin/demo/hf.py``, 4 x 256,
  vocab 4,096), given as the ``teacher`` and ``data/train`` of a finished ``python -m megatron_kd_plugin demo``
  folder (``--hf-teacher``, ``--hf-data``).

``study`` writes, for every teacher, K and candidate, one store through the real writer path (``format.create_store``
and ``writer.store_shard``: the store's own arrays, shards, checksums and records) or, for the layouts the store
does not have (rank order, permutations), the same arrays as plain zarr arrays with the store's shard layout, and
prints one table per teacher and K: bytes/token of ids, of log-probs, of the whole store, and the round-trip KL
KL(exact ‖ stored) over the K+1 ghost buckets per token (mean and max over tokens, nats; the exact side is the
float64 top-K), and the share of tokens whose decoded top-K mass exceeds 1. ``--synthetic V`` adds the synthetic
peaked teacher of ``tools/bench_cache.py`` at vocabulary V.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

KMAX = 100


def topk_rows(logits: torch.Tensor, k: int = KMAX) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, log-probs float64), each ``[..., k]`` in rank order, of logits ``[..., V]`` (float64 softmax)."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top = logprobs.topk(k, dim=-1)
    return top.indices.numpy().astype(np.int32), top.values.numpy()


def save_rows(path: pathlib.Path, tokens: torch.Tensor, logits_of, description: str, micro_batch_size: int = 8):
    """``tokens`` [N, S+1] -> ``path`` (npz): tokens, ids [N, S, KMAX], logprobs [N, S, KMAX], description."""
    ids, logprobs = [], []
    with torch.no_grad():
        for start in range(0, len(tokens), micro_batch_size):
            top = topk_rows(logits_of(tokens[start:start + micro_batch_size, :-1]))         # [b, s, K]
            ids.append(top[0])
            logprobs.append(top[1])
    np.savez(path, tokens=tokens.numpy().astype(np.int32), ids=np.concatenate(ids), logprobs=np.concatenate(logprobs),
             description=description)
    print(f"[prepare] {path}: {description}", flush=True)


def prepare_scratch_teacher(name: str, output: pathlib.Path, samples: int, **overrides) -> None:
    """Trains the quality benchmark's teacher (the ``small`` preset, ``overrides`` applied) and saves its rows."""
    from megatron_kd_plugin.demo import scratch
    from megatron_kd_plugin.demo.data import build_corpus, token_windows
    from megatron_kd_plugin.demo.train import single_process_megatron
    from megatron_kd_plugin.gpt import gpt_logits, load_gpt

    cfg = scratch.PRESETS["small"]
    if "vocab_size" in overrides:
        cfg = dataclasses.replace(cfg, corpus=dataclasses.replace(cfg.corpus, vocab_size=overrides.pop("vocab_size")))
    cfg = dataclasses.replace(cfg, **overrides)
    work = output / name
    corpus = build_corpus(work / "data", cfg.corpus)
    with single_process_megatron(cfg.seed):
        scratch.train_teacher(cfg, corpus, work / "teacher")
        model, spec = load_gpt(work / "teacher", tp_size=1)
        model.eval()
        tokens = token_windows(corpus.train_prefix, cfg.seq_length, max_samples=samples)
        save_rows(output / f"{name}.npz", tokens, lambda t: gpt_logits(model, t).transpose(0, 1).float(),
                  f"bench_quality {name} teacher: megatron GPT {cfg.teacher}, vocab {spec.vocab_size} "
                  f"(tokenizer {corpus.vocab_size}), {cfg.teacher_steps} steps; {len(tokens)} x {cfg.seq_length} "
                  "train tokens")


def prepare_hf_teacher(teacher: pathlib.Path, data: pathlib.Path, output: pathlib.Path, samples: int,
                       seq_length: int) -> None:
    """The demo's trained HF Qwen3 teacher on its train split."""
    from megatron_kd_plugin.demo import hf
    from megatron_kd_plugin.demo.data import token_windows

    model = hf.load(teacher)
    tokens = token_windows(data, seq_length, max_samples=samples)
    save_rows(output / "hf_qwen3.npz", tokens, lambda t: model(input_ids=t, use_cache=False).logits.float(),
              f"demo HF Qwen3 teacher {teacher} ({model.config.num_hidden_layers} x {model.config.hidden_size}, "
              f"vocab {model.config.vocab_size}); {len(tokens)} x {seq_length} train tokens of {data}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("--output", type=pathlib.Path, required=True)
    prep.add_argument("--teachers", nargs="+", default=["confident", "uncertain", "hf_qwen3"])
    prep.add_argument("--samples", type=int, default=64)
    prep.add_argument("--hf-teacher", type=pathlib.Path)
    prep.add_argument("--hf-data", type=pathlib.Path)
    prep.add_argument("--hf-seq-length", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        args.output.mkdir(parents=True, exist_ok=True)
        for name in args.teachers:
            if name == "confident":
                prepare_scratch_teacher(name, args.output, args.samples)
            elif name == "uncertain":
                prepare_scratch_teacher(name, args.output, args.samples, vocab_size=2048, teacher_steps=300)
            elif name == "hf_qwen3":
                if args.hf_teacher is None or args.hf_data is None:
                    parser.error("hf_qwen3 needs --hf-teacher and --hf-data (a finished demo folder's teacher and "
                                 "data/train)")
                prepare_hf_teacher(args.hf_teacher, args.hf_data, args.output, args.samples, args.hf_seq_length)
            else:
                parser.error(f"unknown teacher {name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
