"""Tokenizer transfer: the teacher's own architecture and weights with a new tokenizer, healed from the
teacher's cache by cross-tokenizer KD against CE, in held-out bits per byte.

    python -m megatron_kd_plugin demo --tokenizer-transfer unigram|bpe|PATH [--preset default|mini] [--output DIR]
                                      [--reuse] [--steps N] [--seed N] [--alpha A] [--lr LR]
                                      [--corpus FOLDER_OR_JSONL [--text-key text]]

The tokenizers A (the teacher's) and B, the teacher and its cross-tokenizer store are ``demo --student-tokenizer``'s
(``student_tokenizer.prepare``; ``--reuse`` keeps those of an earlier run of either demo in the folder). The
transferred student is the teacher (its weights, ``teacher.pt``) with B's vocabulary: the embedding row of each B
token is the mean of the teacher's rows of the A tokens that spell it (A's encode of its string; A's longest tokens
where that string is not text), its output row the row of the first of them (the teacher's logit for how the token
begins); B ids A cannot spell (an empty string) take the mean rows. Then, on the same rows, steps and schedule:

    transferred   B, no training: what the teacher knows through the new vocabulary
    KD-healed     B, cross-tokenizer KD from the teacher's cache (the token-level term, kd.token_weight = 1,
                  kd.alpha = ``alpha``)
    CE-healed     B, hard labels only (kd.alpha = 0)

each evaluated like the teacher (bits per byte on the held-out text, each model on its own tokenization).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

from megatron_kd_plugin.demo import student_tokenizer as crosstok
from megatron_kd_plugin.demo.data import CorpusError
from megatron_kd_plugin.demo.stages import STOPPED, add_corpus_arguments, exit_code

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


@dataclasses.dataclass(kw_only=True, frozen=True)
class TransferConfig:
    """The heal's settings (the tokenizers, teacher and store are the cross-tokenizer demo's ``CrossTokConfig``)."""

    steps: int = 80
    """Healing steps, 8 rows each."""
    lr: float = 1e-3
    """Peak learning rate of the heal (cosine to a tenth)."""
    alpha: float = 0.5
    """kd.alpha of the KD heal (its CE share is 1 - alpha at the covered tokens)."""


def spellings(a, b) -> list[list[int]]:
    """For each B id, the A ids that spell its string (``TokenBytes`` ``a``, ``b``): A's encode where it gives the
    string back, else A's longest tokens left to right; [] for an empty string or one A cannot spell."""
    by_string = {string: i for i, string in enumerate(a.strings) if string}
    longest = max(map(len, by_string), default=0)
    out = []
    for string in b.strings:
        ids = []
        try:
            ids = a.encode(string.decode("utf-8")) if string else []
        except UnicodeDecodeError:
            pass
        if b"".join(a.strings[i] for i in ids) != string:
            ids, at = [], 0
            while at < len(string):
                n = next((n for n in range(min(longest, len(string) - at), 0, -1) if string[at:at + n] in by_string),
                         0)
                if n == 0:
                    ids = []
                    break
                ids.append(by_string[string[at:at + n]])
                at += n
        out.append(ids)
    return out


def transferred_state(teacher_state: dict, a, b, vocab_b: int) -> dict:
    """The teacher's state dict with B's embedding and output rows [vocab_b, H] (module docstring)."""
    state = dict(teacher_state)
    embedding, output = teacher_state[EMBEDDING], teacher_state[OUTPUT]                    # [V_A, H]
    new_embedding = embedding.mean(0).repeat(vocab_b, 1)
    new_output = output.mean(0).repeat(vocab_b, 1)
    for token, ids in enumerate(spellings(a, b)):
        if ids:
            new_embedding[token] = embedding[ids].mean(0)
            new_output[token] = output[ids[0]]
    state[EMBEDDING], state[OUTPUT] = new_embedding, new_output
    return state


def run(cfg: crosstok.CrossTokConfig, heal: TransferConfig, out: pathlib.Path, *, student_tokenizer: str,
        reuse: bool = False) -> dict:
    """Every stage into ``out``; returns {"rows": [...], "table": markdown}."""
    from megatron_kd_plugin.cache import TokenBytes

    out.mkdir(parents=True, exist_ok=True)
    tok_a, tok_b, store, heldout, teacher_row = crosstok.prepare(cfg, out, student_tokenizer, reuse)
    weights = out / crosstok.TEACHER_WEIGHTS
    if not weights.is_file():
        raise CorpusError(f"{out} holds no {crosstok.TEACHER_WEIGHTS} (the teacher's weights; made by this version "
                          "of the demo): run without --reuse, or with another --output")
    a, b = TokenBytes.load(tok_a, vocab_size=cfg.vocab), TokenBytes.load(tok_b)
    vocab_b = max(cfg.vocab, len(b.strings))
    state = transferred_state(torch.load(weights, weights_only=True), a, b, vocab_b)
    seq_b = int(cfg.seq_length * 1.5)
    seeds = () if cfg.seed is None else (f"rng.seed={cfg.seed}", f"dataset.seed={cfg.seed}")
    arch = (f"model.num_layers={cfg.teacher_layers}", f"model.hidden_size={cfg.teacher_hidden}",
            f"model.ffn_hidden_size={4 * cfg.teacher_hidden}", "model.num_attention_heads=4",
            f"dataset.student_tokenizer={tok_b}", *seeds)
    heal_cfg = dataclasses.replace(cfg, lr=heal.lr)
    runs = {"transferred (B, before healing)": (0, "kd.alpha=0.0"),
            f"KD-healed (token-level term, alpha={heal.alpha:g})": (heal.steps, f"kd.alpha={heal.alpha}",
                                                                    "kd.token_weight=1.0"),
            "CE-healed": (heal.steps, "kd.alpha=0.0")}
    rows = [teacher_row]
    for name, (steps, *kd) in runs.items():
        run_cfg = crosstok.student_config(heal_cfg, store, vocab_b, seq_b, max(steps, 1), *kd, *arch)
        run_cfg.model.register_pre_wrap_hook(lambda model: _load(model, state))
        model, history, seconds = crosstok.train(run_cfg) if steps else (_built(run_cfg), [], 0.0)
        rows.append(dict(name=name, bpb=crosstok.bits_per_byte(model, tok_b, heldout, seq_b), seconds=seconds,
                         last=history[-1] if history else {}))
    spelt = sum(bool(ids) for ids in spellings(a, b))
    lines = [f"teacher {cfg.teacher_layers}x{cfg.teacher_hidden} ({cfg.teacher_steps} steps) on A (byte-level BPE "
             f"{cfg.vocab}); the same weights with B ({b.identity}, {len(b.strings)} ids, {spelt} of them spelt by A) "
             f"as the student, healed {heal.steps} steps x 8 rows at lr {heal.lr:g} from the top-{cfg.k} cache", "",
             "| model | held-out bits/byte | train s |", "|---|---:|---:|"]
    lines += [f"| {row['name']} | {row['bpb']:.4f} | {row.get('seconds', 0):.0f} |" for row in rows]
    text = "\n".join(lines)
    (out / "transfer_results.md").write_text(text + "\n")
    (out / "transfer_results.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return {"rows": rows, "table": text}


def _built(run_cfg):
    """The model of ``run_cfg`` as built for training (its pre-wrap hooks applied), in eval mode, untrained."""
    from megatron_kd_plugin.bridge.cpu_train import init_cpu_distributed
    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, seed_model_parallel

    apply_cpu_workarounds()
    init_cpu_distributed(run_cfg.model.tensor_model_parallel_size)
    run_cfg.model.finalize()
    seed_model_parallel(run_cfg.rng.seed)
    model = run_cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    model.eval()
    return model


def _load(model: list, state: dict) -> list:
    """Megatron-Bridge's pre-wrap hook: the transferred weights into the freshly built model chunk."""
    model[0].load_state_dict(state, strict=True)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_kd_plugin demo --tokenizer-transfer",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-transfer", required=True, metavar="unigram|bpe|PATH",
                        help="the new tokenizer B (as demo --student-tokenizer takes it)")
    parser.add_argument("--preset", choices=sorted(crosstok.PRESETS), default="default")
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("outputs/demo_transfer"))
    parser.add_argument("--reuse", action="store_true", help="keep the tokenizers, teacher and store there")
    parser.add_argument("--steps", type=int, help="healing steps (default: %s)" % TransferConfig.steps)
    parser.add_argument("--lr", type=float, help="the heal's peak learning rate (default: %s)" % TransferConfig.lr)
    parser.add_argument("--alpha", type=float, help="kd.alpha of the KD heal (default: %s)" % TransferConfig.alpha)
    parser.add_argument("--seed", type=int, help="the heals' rng.seed and dataset.seed")
    parser.add_argument("--teacher-steps", type=int, help="override the preset's teacher steps")
    add_corpus_arguments(parser)
    args = parser.parse_args(argv)
    cfg = crosstok.PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, seed=args.seed, corpus=args.corpus, text_key=args.text_key,
                              **({} if args.teacher_steps is None else {"teacher_steps": args.teacher_steps}))
    heal = TransferConfig(**{name: getattr(args, name) for name in ("steps", "lr", "alpha")
                             if getattr(args, name) is not None},
                          **({} if args.preset != "mini" or args.steps is not None else {"steps": 3}))
    try:
        result = run(cfg, heal, args.output, student_tokenizer=args.tokenizer_transfer, reuse=args.reuse)
    except STOPPED as error:
        return exit_code(error, args.output)
    print(result["table"])
    print(f"\n[demo] results in {args.output}/transfer_results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
