"""Cross-tokenizer distillation quality in bits per byte: how much of the same-tokenizer KD gain does a
student with another tokenizer get from the same cache?

    python -m megatron_kd_plugin demo --student-tokenizer unigram|bpe [--preset default|mini] [--output DIR] [--reuse]
                                      [--alm ALPHA:TAU[:GAMMA] ...] [--steps N] [--teacher-steps N] [--seed N]
                                      [--corpus FOLDER_OR_JSONL [--text-key text]]
    python -m megatron_kd_plugin demo --student-tokenizer PATH ...   # your tokenizer.json (or a folder holding one)

Corpus: the running interpreter's stdlib ``*.py`` sources, or ``--corpus`` a folder of text files / a JSONL file (its
text under ``--text-key``), read as the main demo reads them (``demo.data``); whole documents split into train and
held-out (one in 8) by a hash of their name.
Tokenizer A (the teacher's): byte-level BPE; tokenizer B (the student's): ``unigram`` trains a Unigram (Metaspace) on
the train split, ``bpe`` a byte-level BPE on every other train document, all of ``vocab`` ids; a PATH is used as it is
(it must be lossless on the text: ``token_bytes.check_lossless``). Teacher: a GPT (``teacher_layers`` x
``teacher_hidden``) trained on A-tokenized text with hard labels through the plugin's Bridge CPU path
(``train_on_cpu``, kd.alpha = 0), then cached with ``write_cache`` (top-``k``, plus the cross-tokenizer arrays).
Students of one architecture (the tiny recipe's: 2 layers x 64), one seed, the same rows (one per cached sample: the
same text), steps and learning-rate schedule, each through ``train_on_cpu``:

    A-ce     tokenizer A, hard labels only                      (kd.alpha = 0)
    A-kd     tokenizer A, same-tokenizer top-K KD, ghost tail   (kd.alpha = ``alpha``)
    B-ce     tokenizer B, hard labels only                      (the cross-tokenizer rows, kd.alpha = 0)
    B-kd     tokenizer B, cross-tokenizer KD from the cache, one run per ``--alm ALPHA:TAU[:GAMMA]`` (kd.alpha,
             kd.temperature of the segment term, kd.token_weight = GAMMA: 0 the ALM segment term alone, 1 the
             token-level term alone: the teacher's candidates read as B's next token at every position;
             default ``alpha``:1:GAMMA for GAMMA = 0, 0.5, 1)

Metric: bits per byte on the held-out text, bpb = sum of -log2 q(token) over predicted tokens / their bytes (each
model on its own tokenization, windows of its seq_length). Gain recovered = (bpb(B-ce) - bpb(B-kd)) /
(bpb(A-ce) - bpb(A-kd)). The segment term's pull, measured on the B-ce student: the norm of the gradient of the segment
sum sum_c n_c D_c over the student's logits, over that of the CE sum, on 8 training rows, at each ALM run's tau.
Prints one markdown table (also ``results.md`` and ``results.json`` under the output folder). ``--reuse`` keeps
the tokenizers, teacher and store of an earlier run in the same folder (same settings) and trains only students.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time

import numpy as np
import torch

from megatron_kd_plugin.demo.data import CorpusConfig, CorpusError, corpus_documents, split_documents
from megatron_kd_plugin.demo.stages import STOPPED, add_corpus_arguments, exit_code

RECIPE = "tiny_gpt_kd_cpu_fp32_config"
TEACHER_WEIGHTS = "teacher.pt"
"""The teacher's state dict in the output folder (the tokenizer-transfer demo's starting point)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class CrossTokConfig:
    """The comparison's sizes (``PRESETS``)."""

    vocab: int = 2048
    """Ids of tokenizers A and B (a trained B)."""
    seq_length: int = 128
    """Teacher / tokenizer-A tokens per sample (B rows: 1.5x, to hold a sample's text)."""
    train_bytes: int = 300_000
    heldout_bytes: int = 60_000
    teacher_layers: int = 4
    teacher_hidden: int = 128
    teacher_steps: int = 600
    steps: int = 80
    """Student steps, 8 rows each."""
    k: int = 16
    """Top-K of the cache."""
    alpha: float = 0.5
    """kd.alpha of A-kd (and of B-kd unless ``alm`` says otherwise)."""
    alm: tuple[tuple[float, float, float], ...] = ((0.5, 1.0, 0.0), (0.5, 1.0, 0.5), (0.5, 1.0, 1.0))
    """(kd.alpha, kd.temperature, kd.token_weight) of each B-kd run."""
    lr: float = 3e-3
    seed: int | None = None
    """The students' rng.seed and dataset.seed (None: the recipe's); the teacher keeps the recipe's."""
    corpus: str | None = None
    """A folder of text files or a JSONL file (``demo.data.CorpusConfig.source``); None: the stdlib sources."""
    text_key: str = "text"
    """The field holding a JSONL record's text."""


PRESETS = {
    "default": CrossTokConfig(),
    # for tests: every stage and row, toy sizes
    "mini": CrossTokConfig(vocab=384, seq_length=32, train_bytes=20_000, heldout_bytes=5_000, teacher_layers=1,
                           teacher_hidden=32, teacher_steps=4, steps=3, k=4),
}


def corpus(cfg: CrossTokConfig) -> tuple[list[str], list[str]]:
    """(train, held-out) texts: the documents of ``cfg.corpus`` (the stdlib sources when None), one in 8 held out by
    a hash of its name, each split filled up to its byte budget (``demo.data``, the main demo's corpus reader)."""
    source = CorpusConfig(source=cfg.corpus, text_key=cfg.text_key, train_bytes=cfg.train_bytes,
                          heldout_bytes=cfg.heldout_bytes, heldout_every=8)
    splits = split_documents(corpus_documents(source), source)
    return [doc.read() for doc in splits["train"]], [doc.read() for doc in splits["heldout"]]


STUDENT_KINDS = ("unigram", "bpe")
"""Tokenizers B the demo trains: a Unigram (SentencePiece-style, another family than A) or a byte-level BPE of A's
vocabulary size trained on every other train document (A's family, other merges: Llama 3 against Qwen)."""


def train_tokenizers(train: list[str], vocab: int, folder: pathlib.Path,
                     student: str = "unigram") -> tuple[pathlib.Path, pathlib.Path]:
    """tokenizer.json files of A (byte-level BPE) and B (``student``: one of ``STUDENT_KINDS``), trained on
    ``train``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def byte_level_bpe(texts: list[str]):
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
        return bpe

    if student == "bpe":
        b = byte_level_bpe(train[1::2])
    else:
        b = Tokenizer(models.Unigram())
        b.pre_tokenizer, b.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        b.train_from_iterator(train, trainers.UnigramTrainer(vocab_size=vocab, unk_token="<unk>", show_progress=False,
                                                             special_tokens=["<|endoftext|>", "<unk>"]))
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "a.json", folder / "b.json"
    byte_level_bpe(train).save(str(paths[0]))
    b.save(str(paths[1]))
    return paths


def stream_of(tokenizer_path: pathlib.Path, texts: list[str]) -> np.ndarray:
    """The documents tokenized back to back, each followed by the end-of-document token (``<|endoftext|>`` or, for a
    tokenizer without it, ``</s>`` / ``<eos>``; none: nothing between documents)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>") if tok.token_to_id(t) is not None),
               None)
    end = [] if eos is None else [eos]
    return np.concatenate([np.asarray(e.ids + end, dtype=np.int64)
                           for e in tok.encode_batch(texts, add_special_tokens=False)])


def causal_mask(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s, V] (GPTModel at TP=1 without labels)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, causal_mask(tokens.shape[1]))


def student_config(cfg: CrossTokConfig, store: pathlib.Path, vocab: int, seq: int, steps: int, *extra: str):
    from megatron_kd_plugin.commands.train import build_config

    return build_config(RECIPE, [f"dataset.cache_path={store}", f"model.vocab_size={vocab}", f"model.seq_length={seq}",
                                 f"dataset.seq_length={seq}", f"train.train_iters={steps}",
                                 "train.global_batch_size=8", "train.micro_batch_size=4", f"optimizer.lr={cfg.lr}",
                                 f"optimizer.min_lr={cfg.lr / 10}", "scheduler.lr_decay_style=cosine",
                                 f"scheduler.lr_warmup_iters={min(10, max(1, steps // 8))}", *extra])


def train(run_cfg):
    """(model in eval mode, step history, seconds) of one ``train_on_cpu`` run (seeded by its config's rng.seed)."""
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu

    begin = time.perf_counter()
    models, history = train_on_cpu(run_cfg, progress=False)
    model = models[0]
    model.eval()
    return model, history, time.perf_counter() - begin


@torch.no_grad()
def bits_per_byte(model, tokenizer_path: pathlib.Path, heldout: list[str], seq: int) -> float:
    """Held-out bits per byte: the documents tokenized back to back, windows of seq + 1 tokens (one shared)."""
    from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes

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


def segment_pull(model, rows: list, temperature: float) -> float:
    """||d segment_sum / d logits|| / ||d ce_sum / d logits|| on ``rows`` (``KDRow``s; float64; the ALM loss's two
    terms)."""
    from megatron_kd_plugin.loss.cross_tokenizer_loss import binarised_divergence

    batch = torch.utils.data.default_collate(rows)                                           # a batch-first KDRow
    with torch.no_grad():
        logits = logits_of(model, batch.tokens).double()                                    # [b, s, V]
    logits.requires_grad_()
    logp = torch.log_softmax(logits, -1).gather(-1, batch.labels[..., None]).squeeze(-1)   # [b, s]
    mask = batch.loss_mask.double()
    ce = -(mask * logp).sum()
    ids, segment = batch.teacher.segment_ids, logp.new_zeros(())
    for b in range(ids.shape[0]):
        used = ids[b] >= 0
        sums = logp.new_zeros(ids.shape[1]).index_add(0, ids[b][used], logp[b][used])
        sizes = torch.bincount(ids[b][used], minlength=ids.shape[1]).double()
        live = sizes > 0
        d = binarised_divergence(batch.teacher.segment_logprobs[b].double()[live], sums[live],
                                 divergence="forward_kl", jsd_beta=0.5, temperature=temperature)
        segment = segment + (sizes[live] * d).sum()
    grad_segment, = torch.autograd.grad(segment, logits, retain_graph=True)
    grad_ce, = torch.autograd.grad(ce, logits)
    return float(grad_segment.norm() / grad_ce.norm())


def prepare(cfg: CrossTokConfig, out: pathlib.Path, student_tokenizer: str, reuse: bool):
    """Tokenizers, teacher and store (kept from an earlier run with ``reuse``); (paths, texts, teacher bpb row)."""
    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes, check_lossless
    from megatron_kd_plugin.cache.writer import write_cache

    train_texts, heldout = corpus(cfg)
    store, teacher_row = out / "teacher_xtok.zarr", out / "teacher.json"
    if reuse and store.is_dir() and teacher_row.is_file():
        row = json.loads(teacher_row.read_text())
        if row.get("corpus") != cfg.corpus:
            raise CorpusError(f"--reuse: the teacher and store in {out} were made from the corpus "
                              f"{row.get('corpus')!r}, not {cfg.corpus!r}; drop --reuse or use another --output")
        return out / "tokenizers" / "a.json", pathlib.Path(row["student"]), store, heldout, row
    tok_a, tok_b = train_tokenizers(train_texts, cfg.vocab, out / "tokenizers",
                                    student_tokenizer if student_tokenizer in STUDENT_KINDS else "unigram")
    if student_tokenizer not in STUDENT_KINDS:
        tok_b = pathlib.Path(student_tokenizer)
        tok_b = tok_b / "tokenizer.json" if tok_b.is_dir() else tok_b
    table_a = TokenBytes.load(tok_a, vocab_size=cfg.vocab)
    check_lossless(table_a, train_texts[:16], what="tokenizer A")
    check_lossless(TokenBytes.load(tok_b), train_texts[:16], what="tokenizer B")
    seq, vocab = cfg.seq_length, cfg.vocab
    source = TokenWindows(stream_of(tok_a, train_texts), seq, num_samples=None, fingerprint="demo-crosstok",
                          tokenizer="A", tokenizer_vocab_size=vocab)
    # the teacher: hard labels through the same CPU path, on a store whose teacher part it ignores (alpha = 0)
    zero = lambda tokens, position_ids: torch.zeros(tokens.shape[1], tokens.shape[0], vocab)       # noqa: E731
    plain = out / "ce_rows.zarr"
    write_cache(source, zero, plain, k=1, vocab_size=vocab, teacher="none", samples_per_shard=16, progress=False,
                overwrite=True)
    teacher, _, seconds = train(student_config(
        cfg, plain, vocab, seq, cfg.teacher_steps, "kd.alpha=0.0", "dataset.k=1",
        f"model.num_layers={cfg.teacher_layers}", f"model.hidden_size={cfg.teacher_hidden}",
        f"model.ffn_hidden_size={4 * cfg.teacher_hidden}", "model.num_attention_heads=4"))
    torch.save(teacher.state_dict(), out / TEACHER_WEIGHTS)
    write_cache(source, lambda tokens, position_ids: logits_of(teacher, tokens).transpose(0, 1), store, k=cfg.k, vocab_size=vocab,
                teacher="demo-crosstok-teacher", samples_per_shard=16, progress=False, vocab_table=table_a,
                overwrite=True)
    row = dict(name=f"teacher (A, {cfg.teacher_layers}x{cfg.teacher_hidden})",
               bpb=bits_per_byte(teacher, tok_a, heldout, seq), seconds=seconds, student=str(tok_b.resolve()),
               corpus=cfg.corpus)
    teacher_row.write_text(json.dumps(row) + "\n")
    return tok_a, tok_b, store, heldout, row


def run(cfg: CrossTokConfig, out: pathlib.Path, *, student_tokenizer: str = "unigram", reuse: bool = False) -> dict:
    """Every stage into ``out``; returns {"rows": [...], "table": markdown}."""
    from megatron_kd_plugin.cache import KDRows, TokenBytes, TopKCacheReader, row_kind

    out.mkdir(parents=True, exist_ok=True)
    tok_a, tok_b, store, heldout, teacher_row = prepare(cfg, out, student_tokenizer, reuse)
    seq, seq_b = cfg.seq_length, int(cfg.seq_length * 1.5)          # B's rows hold a cached sample's text
    table_b = TokenBytes.load(tok_b)
    vocab_b = max(cfg.vocab, len(table_b.strings))
    b_tok = f"dataset.student_tokenizer={tok_b}"
    seeds = () if cfg.seed is None else (f"rng.seed={cfg.seed}", f"dataset.seed={cfg.seed}")
    runs = {"A-ce": (student_config(cfg, store, cfg.vocab, seq, cfg.steps, "kd.alpha=0.0", f"dataset.k={cfg.k}",
                                    *seeds), tok_a, seq, None),
            "A-kd": (student_config(cfg, store, cfg.vocab, seq, cfg.steps, f"kd.alpha={cfg.alpha}",
                                    f"dataset.k={cfg.k}", *seeds), tok_a, seq, None),
            "B-ce": (student_config(cfg, store, vocab_b, seq_b, cfg.steps, "kd.alpha=0.0", b_tok, *seeds),
                     tok_b, seq_b, None)}
    for alpha, tau, gamma in cfg.alm:
        runs[kd_name(alpha, tau, gamma)] = (student_config(
            cfg, store, vocab_b, seq_b, cfg.steps, f"kd.alpha={alpha}", f"kd.temperature={tau}",
            f"kd.token_weight={gamma}", b_tok, *seeds), tok_b, seq_b, tau)
    rows, models = [teacher_row], {}
    for name, (run_cfg, tok, s, _) in runs.items():
        model, history, seconds = train(run_cfg)
        models[name] = model
        rows.append(dict(name=name, bpb=bits_per_byte(model, tok, heldout, s), seconds=seconds, last=history[-1]))
    reader = TopKCacheReader(store)
    count = min(256, len(reader))
    data = KDRows(row_kind(reader, seq_length=seq_b, student=table_b, alignments="memory"), np.arange(count),
                  num_rows=count, seed=0, shuffle=False)
    b_rows = [data[i] for i in range(count)]
    for row in rows:
        tau = runs.get(row["name"], (None,) * 4)[3]
        if tau is not None:
            row["segment_pull"] = segment_pull(models["B-ce"], b_rows[:8], tau)
    bpb = {row["name"]: row["bpb"] for row in rows}
    same_gain = bpb["A-ce"] - bpb["A-kd"]
    labels = float(np.mean([float(r.loss_mask.sum()) for r in b_rows]))
    segmented = float(np.mean([float((r.teacher.segment_ids >= 0).sum() / max(float(r.loss_mask.sum()), 1.0))
                               for r in b_rows]))
    coverage = token_coverage(b_rows, reader, table_b)
    lines = [f"teacher {cfg.teacher_layers}x{cfg.teacher_hidden} ({cfg.teacher_steps} steps), students 2x64, "
             f"{cfg.steps} steps x 8 rows, vocab {cfg.vocab} (A: byte-level BPE, B: {table_b.identity}), top-{cfg.k} "
             f"cache, A-kd alpha {cfg.alpha}; {len(reader)} cached samples of {seq} A-tokens; B rows (seq_length "
             f"{seq_b}) hold {labels:.1f} labels on average, {segmented:.3f} of them in a used segment; the "
             f"token-level term covers {coverage['covered']:.3f} of them ({coverage['boundary']:.3f} at a teacher "
             f"token boundary, {coverage['inside']:.3f} inside a teacher token), where {coverage['mass']:.3f} of the teacher's "
             f"probability reaches a B token; the context-free first token of the realised teacher token's bytes is "
             f"B's own next token at {coverage['agree boundary']:.3f} of the boundary positions and "
             f"{coverage['agree inside']:.3f} of those inside a token (B's token runs past the teacher token at "
             f"{coverage['runs past']:.3f} of all)", "",
             "| model | held-out bits/byte | gain over its CE | fraction of the same-tokenizer gain | segment/CE "
             "gradient norm | train s |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        base = bpb["A-ce"] if row["name"].startswith("A-") else bpb["B-ce"] if row["name"].startswith("B-") else None
        gain = "" if base is None or row["name"].endswith("-ce") else f"{base - row['bpb']:+.4f}"
        fraction = f"{(base - row['bpb']) / same_gain:.2f}" if gain and same_gain else ""
        pull = f"{row['segment_pull']:.3f}" if "segment_pull" in row else ""
        lines.append(f"| {row['name']} | {row['bpb']:.4f} | {gain} | {fraction} | {pull} | {row['seconds']:.0f} |")
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(rows + [dict(name="coverage", **coverage)], indent=1,
                                                 default=str) + "\n")
    return {"rows": rows, "table": text, "coverage": coverage}


def token_coverage(rows: list, reader, student) -> dict[str, float]:
    """The token-level term on ``rows`` (B's ``KDRow``s of ``reader``'s first samples): the fractions of the labels it
    covers (at a teacher token boundary / inside a teacher token), the mean teacher probability reaching a B token
    there, and how often ``first_tokens``' context-free first token of the realised teacher token's remaining bytes
    is B's own next token (at the boundary positions / inside a token; ``runs past``: B's next token ends after the
    realised teacher token, where no first token of it can be)."""
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.cache.cross_tokenizer.align import byte_ends
    from megatron_kd_plugin.cache.cross_tokenizer.first_tokens import FirstTokens
    from megatron_kd_plugin.cache.cross_tokenizer.token_slots import read_positions
    from megatron_kd_plugin.loss import tensor_map
    from megatron_kd_plugin.loss.cross_tokenizer_loss import token_teacher

    counts = dict.fromkeys(("labels", "covered", "boundary", "inside", "mass"), 0.0)
    for row in rows:
        target = token_teacher(tensor_map(lambda t: t[:, None], row.teacher), row.labels[:, None])
        probs = target.logprobs[:, 0].double().exp().sum(-1)                                  # [S_s]
        covered = (probs > 0) & (row.loss_mask > 0)
        boundary = covered & (row.teacher.token_positions >= 0)
        counts["labels"] += float(row.loss_mask.sum())
        counts["covered"] += float(covered.sum())
        counts["boundary"] += float(boundary.sum())
        counts["inside"] += float((covered & ~boundary).sum())
        counts["mass"] += float(probs[covered].sum())
    teacher = reader.vocab_table()
    table = FirstTokens.compute(teacher, student)
    agree = dict.fromkeys(("boundary", "inside", "agree boundary", "agree inside", "runs past"), 0)
    for sample in range(len(rows)):
        tokens = reader.sample_arrays(sample, (fmt.TOKENS,))[fmt.TOKENS].astype(np.int64)
        teacher_ends, ids, ends, _ = byte_ends(tokens, teacher, student)
        sources, offsets = read_positions(teacher_ends, ends)
        j = np.flatnonzero(sources >= 0)
        t, o = sources[j], offsets[j]
        same = table.first[table.base[tokens[t + 1]] + o] == ids[j + 1]
        for name, where in (("boundary", o == 0), ("inside", o > 0)):
            agree[name] += int(where.sum())
            agree["agree " + name] += int((same & where).sum())
        agree["runs past"] += int((ends[j + 1] > teacher_ends[t + 1]).sum())
    labels = max(counts["labels"], 1.0)
    return dict(covered=counts["covered"] / labels, boundary=counts["boundary"] / labels,
                inside=counts["inside"] / labels, mass=counts["mass"] / max(counts["covered"], 1.0),
                **{f"agree {name}": agree[f"agree {name}"] / max(agree[name], 1) for name in ("boundary", "inside")},
                **{"runs past": agree["runs past"] / max(agree["boundary"] + agree["inside"], 1)})


def kd_name(alpha: float, tau: float, gamma: float) -> str:
    return f"B-kd alpha={alpha:g} tau={tau:g} gamma={gamma:g}"


def alm_run(text: str) -> tuple[float, float, float]:
    try:
        values = [float(v) for v in text.split(":")]
        if len(values) not in (2, 3):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--alm {text!r}: expected ALPHA:TAU or ALPHA:TAU:GAMMA, e.g. 0.5:1 or "
                                         "0.5:1:0.5") from None
    return values[0], values[1], values[2] if len(values) == 3 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_kd_plugin demo --student-tokenizer",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student-tokenizer", required=True, metavar="unigram|bpe|PATH",
                        help="the students' tokenizer B: 'unigram' (trained on the train split), 'bpe' (a byte-level "
                             "BPE of A's size trained on every other train document) or a tokenizer.json")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("outputs/demo_crosstok"))
    parser.add_argument("--reuse", action="store_true", help="keep the teacher and store of an earlier run there")
    parser.add_argument("--alm", type=alm_run, nargs="+", metavar="ALPHA:TAU[:GAMMA]",
                        help="one B-kd run per kd.alpha:kd.temperature[:kd.token_weight] (default: the preset's "
                             "alpha:1, alpha:1:0.5 and alpha:1:1)")
    for name in ("steps", "teacher_steps", "vocab", "train_bytes", "heldout_bytes", "teacher_hidden", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"override the preset's {name}")
    parser.add_argument("--alpha", type=float, help="override the preset's A-kd alpha")
    add_corpus_arguments(parser)
    args = parser.parse_args(argv)
    changes = {name: getattr(args, name) for name in ("steps", "teacher_steps", "vocab", "train_bytes",
                                                      "heldout_bytes", "teacher_hidden", "alpha", "seed", "corpus")
               if getattr(args, name) is not None}
    cfg = dataclasses.replace(PRESETS[args.preset], **changes)
    cfg = dataclasses.replace(cfg, alm=tuple(args.alm) if args.alm else tuple((cfg.alpha, 1.0, gamma)
                                                                              for gamma in (0.0, 0.5, 1.0)))
    cfg = dataclasses.replace(cfg, text_key=args.text_key)
    try:
        result = run(cfg, args.output, student_tokenizer=args.student_tokenizer, reuse=args.reuse)
    except STOPPED as error:
        return exit_code(error, args.output)
    print(result["table"])
    print(f"\n[demo] results in {args.output}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
