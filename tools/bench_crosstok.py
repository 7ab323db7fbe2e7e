"""Cross-tokenizer distillation quality in bits per byte (issue #18): how much of the same-tokenizer KD gain does a
student with another tokenizer get from the same cache?

    python tools/bench_crosstok.py [--steps 300] [--teacher-steps 600] [--output bench_results/crosstok]

Corpus: the running interpreter's stdlib ``*.py`` sources, whole files split into train and held-out by name hash.
Tokenizer A: byte-level BPE; tokenizer B: Unigram (Metaspace); both ``--vocab`` ids, trained on the train split.
Teacher: a GPT (``--teacher-layers`` x ``--teacher-hidden``) trained on A-tokenized text with hard labels through the
plugin's Bridge CPU path (``train_on_cpu``, kd.alpha = 0), then cached with ``write_cache`` (top-``--k``, plus the
cross-tokenizer arrays). Four students of one architecture (the tiny recipe's: 2 layers x 64), one seed, the same
rows (one per cached sample: the same text), steps and learning-rate schedule, each through ``train_on_cpu``:

    A-ce     tokenizer A, hard labels only                      (kd.alpha = 0)
    A-kd     tokenizer A, same-tokenizer top-K KD, ghost tail   (kd.alpha = ``--alpha``)
    B-ce     tokenizer B, hard labels only                      (the cross-tokenizer rows, kd.alpha = 0)
    B-alm    tokenizer B, ALM chunk-likelihood KD from the cache (kd.alpha = ``--alpha``)

Metric: bits per byte on the held-out text, bpb = sum of -log2 q(token) over predicted tokens / their bytes
(each model on its own tokenization, windows of its seq_length). Gain recovered = (bpb(B-ce) - bpb(B-alm)) /
(bpb(A-ce) - bpb(A-kd)). Prints one markdown table (also ``results.md`` under ``--output``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import sys
import sysconfig
import time

import numpy as np
import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def corpus(max_bytes: int, heldout_bytes: int) -> tuple[list[str], list[str]]:
    """(train, held-out) stdlib sources; one file in 8 (by name hash) is held out."""
    train, heldout, sizes = [], [], [0, 0]
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        side = int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 8 == 0
        if sizes[side] < (heldout_bytes if side else max_bytes):
            (heldout if side else train).append(text)
            sizes[side] += len(text.encode())
    return train, heldout


def tokenizers(train: list[str], vocab: int, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """tokenizer.json files of A (byte-level BPE) and B (Unigram), trained on ``train``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(train, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer, uni.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    uni.train_from_iterator(train, trainers.UnigramTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<unk>"],
                                                           unk_token="<unk>", show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "a.json", folder / "b.json"
    bpe.save(str(paths[0]))
    uni.save(str(paths[1]))
    return paths


def stream_of(tokenizer_path: pathlib.Path, texts: list[str]) -> np.ndarray:
    """The documents tokenized back to back, each followed by <|endoftext|> (id of that token)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("<|endoftext|>")
    return np.concatenate([np.asarray(e.ids + [eos], dtype=np.int64)
                           for e in tok.encode_batch(texts, add_special_tokens=False)])


def causal_mask(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s, V] (GPTModel at TP=1 without labels)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, causal_mask(tokens.shape[1]))


def config(store: pathlib.Path, vocab: int, seq: int, steps: int, *extra: str, recipe="tiny_gpt_kd_cpu_fp32_config"):
    from megatron_kd_plugin.commands.train import build_config

    return build_config(recipe, [f"dataset.cache_path={store}", f"model.vocab_size={vocab}", f"model.seq_length={seq}",
                                 f"dataset.seq_length={seq}", f"train.train_iters={steps}",
                                 "train.global_batch_size=8", "train.micro_batch_size=4", "optimizer.lr=3e-3",
                                 "optimizer.min_lr=3e-4", "scheduler.lr_decay_style=cosine",
                                 "scheduler.lr_warmup_iters=10", *extra])


def train(cfg):
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu

    begin = time.perf_counter()
    models, history = train_on_cpu(cfg, progress=False)
    model = models[0]
    model.eval()
    return model, history, time.perf_counter() - begin


@torch.no_grad()
def bits_per_byte(model, tokenizer_path: pathlib.Path, heldout: list[str], seq: int) -> float:
    """Held-out bits per byte: the documents tokenized back to back, windows of seq + 1 tokens (one shared)."""
    from megatron_kd_plugin.cache.token_bytes import TokenBytes

    table = TokenBytes.load(tokenizer_path)
    stream = torch.from_numpy(stream_of(tokenizer_path, heldout))
    windows = (len(stream) - 1) // seq
    nats, total_bytes = 0.0, 0
    for start in range(0, windows, 8):
        rows = torch.stack([stream[i * seq:i * seq + seq + 1] for i in range(start, min(start + 8, windows))])
        logp = torch.log_softmax(logits_of(model, rows[:, :-1]).double(), -1)
        nats -= float(logp.gather(-1, rows[:, 1:, None]).sum())
        total_bytes += int(table.lengths[rows[:, 1:].numpy()].sum())
    return nats / math.log(2) / total_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-length", type=int, default=128, help="teacher / tokenizer-A tokens per sample")
    parser.add_argument("--train-bytes", type=int, default=3_000_000)
    parser.add_argument("--heldout-bytes", type=int, default=200_000)
    parser.add_argument("--teacher-layers", type=int, default=4)
    parser.add_argument("--teacher-hidden", type=int, default=192)
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=300, help="student steps (8 rows each)")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--output", default="bench_results/crosstok")
    args = parser.parse_args(argv)

    from megatron_kd_plugin.cache.sources import TokenWindows
    from megatron_kd_plugin.cache.token_bytes import TokenBytes, check_lossless
    from megatron_kd_plugin.cache.writer import write_cache
    from megatron_kd_plugin.cpu_compat import seed_model_parallel

    out = pathlib.Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    train_texts, heldout = corpus(args.train_bytes, args.heldout_bytes)
    tok_a, tok_b = tokenizers(train_texts, args.vocab, out / "tokenizers")
    table_a = TokenBytes.load(tok_a, vocab_size=args.vocab)
    check_lossless(table_a, train_texts[:16], what="tokenizer A")
    check_lossless(TokenBytes.load(tok_b), train_texts[:16], what="tokenizer B")
    stream = stream_of(tok_a, train_texts)
    seq = args.seq_length
    source = TokenWindows(stream, seq, num_samples=None, fingerprint="bench-crosstok", tokenizer="A",
                          tokenizer_vocab_size=args.vocab)
    vocab = args.vocab
    # the teacher: hard labels through the same CPU path, on a store whose teacher part it ignores (alpha = 0)
    zero = lambda tokens: torch.zeros(tokens.shape[1], tokens.shape[0], vocab)       # noqa: E731
    plain = out / "ce_rows.zarr"
    write_cache(source, zero, plain, k=1, vocab_size=vocab, teacher="none", samples_per_shard=16, progress=False,
                overwrite=True)
    teacher_cfg = config(plain, vocab, seq, args.teacher_steps, "kd.alpha=0.0", "dataset.k=1",
                         f"model.num_layers={args.teacher_layers}", f"model.hidden_size={args.teacher_hidden}",
                         f"model.ffn_hidden_size={4 * args.teacher_hidden}", "model.num_attention_heads=4")
    teacher, _, teacher_time = train(teacher_cfg)
    store = out / "teacher_xtok.zarr"
    write_cache(source, lambda tokens: logits_of(teacher, tokens).transpose(0, 1), store, k=args.k, vocab_size=vocab,
                teacher="bench-teacher", samples_per_shard=16, progress=False, vocab_table=table_a, overwrite=True)
    rows = []
    teacher_bpb = bits_per_byte(teacher, tok_a, heldout, seq)
    rows.append(dict(name="teacher (A)", bpb=teacher_bpb, seconds=teacher_time))
    seq_b = int(seq * 1.5)                                    # B's rows hold a cached sample's text
    runs = {
        "A-ce": (config(store, vocab, seq, args.steps, "kd.alpha=0.0", f"dataset.k={args.k}"), tok_a, seq),
        "A-kd": (config(store, vocab, seq, args.steps, f"kd.alpha={args.alpha}", f"dataset.k={args.k}"), tok_a, seq),
        "B-ce": (config(store, vocab, seq_b, args.steps, "kd.alpha=0.0", f"dataset.student_tokenizer={tok_b}"),
                 tok_b, seq_b),
        "B-alm": (config(store, vocab, seq_b, args.steps, f"kd.alpha={args.alpha}",
                         f"dataset.student_tokenizer={tok_b}"), tok_b, seq_b),
    }
    for name, (cfg, tok, s) in runs.items():
        seed_model_parallel(cfg.rng.seed)
        model, history, seconds = train(cfg)
        rows.append(dict(name=name, bpb=bits_per_byte(model, tok, heldout, s), seconds=seconds,
                         last=history[-1]))
    from megatron_kd_plugin.bridge.dataset import CrossTokenizerDataset
    from megatron_kd_plugin.cache import TopKCacheReader

    reader = TopKCacheReader(store)
    sample_rows = CrossTokenizerDataset(reader, np.arange(min(256, len(reader))), student=TokenBytes.load(tok_b),
                                        seq_length=seq_b, num_rows=min(256, len(reader)), seed=0, shuffle=False)
    b_rows = [sample_rows[i] for i in range(len(sample_rows))]
    b_labels = float(np.mean([float(r["loss_mask"].sum()) for r in b_rows]))
    b_chunked = float(np.mean([float((r["chunk_ids"] >= 0).sum() / r["loss_mask"].sum()) for r in b_rows]))
    bpb = {row["name"]: row["bpb"] for row in rows}
    same_gain = bpb["A-ce"] - bpb["A-kd"]
    cross_gain = bpb["B-ce"] - bpb["B-alm"]
    lines = [f"teacher {args.teacher_layers}x{args.teacher_hidden} ({args.teacher_steps} steps), students 2x64, "
             f"{args.steps} steps x 8 rows, vocab {vocab} (A: byte-level BPE, B: Unigram), top-{args.k} cache, "
             f"alpha {args.alpha}; {len(source)} cached samples of {seq} A-tokens; B rows (seq_length {seq_b}) hold "
             f"{b_labels:.1f} labels on average, {b_chunked:.3f} of them in a used chunk", "",
             "| model | held-out bits/byte | train s |", "|---|---:|---:|"]
    lines += [f"| {row['name']} | {row['bpb']:.4f} | {row['seconds']:.0f} |" for row in rows]
    lines += ["", f"same-tokenizer KD gain over CE (A): {same_gain:+.4f} bpb; cross-tokenizer ALM gain over CE (B): "
              f"{cross_gain:+.4f} bpb; fraction recovered {cross_gain / same_gain:.2f}" if same_gain else ""]
    text = "\n".join(lines)
    print(text)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
