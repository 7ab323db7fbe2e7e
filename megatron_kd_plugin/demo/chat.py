"""The demo on conversations: a chat teacher cached once on packed assistant-only rows, its pruned copy healed by
KD and by CE, both scored on held-out assistant tokens.

    python -m megatron_kd_plugin demo --chat [--output outputs/demo_chat] [--preset default|mini] [--overwrite]
                                             [--seed N] [--teacher-steps N] [--heal-steps N]
                                             [--corpus FOLDER_OR_JSONL [--text-key text] | --stdlib FOLDER]

The main demo's stages (``megatron_kd_plugin.demo.pipeline``) on conversations; what differs:

1. data           the main demo's corpus, split by whole document, its BPE tokenizer with the two ChatML markers
                  added as special tokens (``demo.conversations``); then ``conversations``: each document's
                  conversations (user: an instruction and a stretch of the file; assistant: the text that follows),
                  written as ``chat/train.jsonl`` / ``chat/heldout.jsonl`` of ``messages``, each fitted into one row
                  of S + 1 tokens; the tokenizer with the chat template (``chat/tokenizer/``) and the rendered train
                  conversations as a Megatron indexed dataset (``chat/train.bin/.idx``);
2. teacher        a chat teacher: the main demo's Qwen3 trained with cross entropy on the rendered train
                  conversations (markup and all, as a stream of windows). Real chat teachers have seen their
                  template; one that never saw ``<|im_start|>`` would predict the assistant's text after untrained
                  embeddings. Its folder carries the chat template;
3. compress       as the main demo, calibrated on rendered conversations;
4. cache          ``cache --data chat/train.jsonl --input-kind messages --layout packed``: the teacher once, whole
                  conversations packed into ``cache_samples`` rows, loss mask 1 on the assistant's tokens only;
5. heal           KD at the main demo's rate, and CE at every rate of ``ce_lrs`` (the CE control's sweep on this
                  data), all from the same pruned weights, rows, steps, schedule and seed; the CE heal compared is
                  the sweep's best held-out perplexity (chosen on the evaluation itself: that favours CE, not KD);
                  no plan stage (the main demo's ``plan.txt`` shows the same heal's);
6. eval           every model by transformers on ``eval_conversations`` held-out conversations spread over the
                  held-out split, each alone as its own sequence: perplexity, KL(teacher || model) and ECE over the
                  assistant's tokens only (the cache's mask: ``conversation_documents`` on ``chat/heldout.jsonl``),
                  KD against CE by the paired bootstrap over the held-out files (``demo.bootstrap``).

``--layout stream`` is refused (conversations are cached as packed rows), as are the other demos' flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys

import numpy as np
import torch

from megatron_kd_plugin.demo import conversations as chat_data
from megatron_kd_plugin.demo import data
from megatron_kd_plugin.demo.pipeline import PRESETS as PIPELINE_PRESETS
from megatron_kd_plugin.demo.pipeline import (
    HealConfig,
    cache_command,
    commands_file,
    compress_teacher,
    demo_parser,
    exported_student,
    heal_arguments,
    outcome,
    package_command,
    plot_results,
    results_table,
    row_figures,
    run_command,
    train_teacher,
)
from megatron_kd_plugin.demo.scratch import start_run
from megatron_kd_plugin.demo.stages import STOPPED, StageClock, exit_code

TOKENS = "held-out assistant"
"""What the evaluation scores, in the table's words."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class ChatConfig:
    """The chat demo: the main demo's settings (``heal``) and the conversations'."""

    heal: HealConfig = PIPELINE_PRESETS["default"]
    """Corpus, teacher, compression, cache and heal settings (``pipeline.HealConfig``; its layout must be packed)."""
    prompt_chars: tuple[int, int] = (120, 260)
    """Characters of a user turn's stretch of the file (drawn uniformly in the range)."""
    answer_chars: tuple[int, int] = (100, 220)
    """Characters of the assistant's turn (drawn uniformly), before fitting into a row."""
    ce_lrs: tuple[float, ...] = (1.25e-4, 2.5e-4, 5e-4, 1e-3)
    """The CE control's peak learning rates, each a heal; the best held-out perplexity is the one compared. The best
    of 6.25e-5 ... 2e-3 on the default preset was 1.25e-4 (seed 1234; 6.25e-5 worse) and 2.5e-4 (seed 7);
    2e-3 was the worst on both (docs/benchmarks.md)."""
    eval_conversations: int = 512
    """Held-out conversations evaluated, spread evenly over the held-out split's conversations."""

    def __post_init__(self):
        if self.heal.layout != "packed":
            raise ValueError(f"--chat caches conversations as packed rows (whole conversations, assistant-only "
                             f"masks); layout {self.heal.layout!r} cannot hold their masks")
        for name in ("prompt_chars", "answer_chars"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"ChatConfig.{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
        if not self.ce_lrs or min(self.ce_lrs) <= 0:
            raise ValueError(f"ChatConfig.ce_lrs must be positive rates, got {self.ce_lrs}")
        if self.eval_conversations < 1:
            raise ValueError(f"ChatConfig.eval_conversations must be >= 1, got {self.eval_conversations}")

    @property
    def corpus(self) -> data.CorpusConfig:
        return self.heal.corpus

    def corpus_needs(self) -> dict[str, tuple[int, str]]:
        """The main demo's: the conversations hold about as many tokens as their text."""
        return self.heal.corpus_needs()


PRESETS = {
    "default": ChatConfig(),
    # the main demo's miniature (512-token vocabulary) at S = 64 (a row of 33 tokens holds the markup, the
    # instruction and little else), 100 teacher steps, the cache at TP 1 (its test's time): short stretches, two CE
    # rates (the sweep's choice is exercised), 32 held-out conversations
    "mini": ChatConfig(heal=dataclasses.replace(PIPELINE_PRESETS["mini"], seq_length=64,
                                                teacher_steps=100, cache_tp=1),
                       prompt_chars=(20, 60), answer_chars=(20, 50), ce_lrs=(5e-4, 2e-3), eval_conversations=32),
}


@dataclasses.dataclass(kw_only=True, frozen=True)
class HeldoutConversations:
    """The evaluated held-out conversations: tokens and assistant targets as the cache reads them."""

    tokens: list[torch.Tensor]
    """Per conversation [L] int64 (the end-of-document id last)."""
    targets: list[torch.Tensor]
    """Per conversation [L] uint8: 1 where the token is the assistant's (a loss target)."""
    files: list[int]
    """The held-out document each came from."""


def write_conversations(cfg: ChatConfig, corpus: data.DemoCorpus, folder: pathlib.Path,
                        ) -> tuple[data.DemoCorpus, dict]:
    """The conversations of both splits into ``folder`` (module docstring, stage 1); returns the corpus the teacher
    and the compression read (``train_prefix``: the rendered train conversations; ``chat_template`` set) and the
    conversations' figures."""
    from megatron_kd_plugin.demo import qwen3_models
    from transformers import AutoTokenizer

    folder.mkdir(parents=True)
    qwen3_models.save_tokenizer(corpus.tokenizer_path, folder / "tokenizer", chat_data.CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    splits = data.split_documents(data.corpus_documents(cfg.corpus), cfg.corpus)
    stats = {}
    for name, documents in splits.items():
        conversations, files, tokens, dropped = chat_data.split_conversations(
            [d.read() for d in documents], [d.name for d in documents], tokenizer, seed=cfg.heal.seed,
            prompt_chars=cfg.prompt_chars, answer_chars=cfg.answer_chars, max_tokens=cfg.heal.seq_length + 1)
        if not conversations:
            raise data.CorpusError(f"the {name} split makes no conversation that fits a row of "
                                   f"{cfg.heal.seq_length + 1} tokens")
        with (folder / f"{name}.jsonl").open("w") as out:
            out.writelines(json.dumps({"messages": messages}) + "\n" for messages in conversations)
        (folder / f"{name}_files.json").write_text(json.dumps(files) + "\n")
        if name == "train":
            data.write_indexed_dataset(folder / "train", [np.asarray(ids, dtype=np.int32) for ids in tokens])
        stats[name] = {"conversations": len(conversations), "files": len(set(files)), "dropped": dropped,
                       "tokens": sum(map(len, tokens))}
    chat_corpus = dataclasses.replace(corpus, train_prefix=folder / "train", vocab_size=len(tokenizer),
                                      chat_template=chat_data.CHAT_TEMPLATE)
    return chat_corpus, stats


def heldout_conversations(cfg: ChatConfig, folder: pathlib.Path) -> HeldoutConversations:
    """``cfg.eval_conversations`` of ``folder/heldout.jsonl``'s conversations, spread evenly (conversation
    ``i * n // count``), rendered and masked by the cache's own conversation source."""
    from megatron_kd_plugin.cache.sources.conversation_documents import conversation_documents
    from megatron_kd_plugin.cache.sources.source_files import load_tokenizer

    documents = conversation_documents(str(folder / "heldout.jsonl"), load_tokenizer(str(folder / "tokenizer")))
    files = json.loads((folder / "heldout_files.json").read_text())
    count = min(cfg.eval_conversations, len(files))
    chosen = [i * len(files) // count for i in range(count)]
    tokens = torch.from_numpy(documents.tokens.astype(np.int64))
    targets = torch.from_numpy(documents.targets)
    bounds = documents.offsets.tolist()
    return HeldoutConversations(tokens=[tokens[bounds[i]:bounds[i + 1]] for i in chosen],
                                targets=[targets[bounds[i]:bounds[i + 1]] for i in chosen],
                                files=[files[i] for i in chosen])


@torch.no_grad()
def evaluate_chat(cfg: ChatConfig, corpus: data.DemoCorpus, heldout: HeldoutConversations,
                  folders: dict[str, pathlib.Path]) -> dict:
    """Every model by transformers on the held-out conversations' assistant tokens, each conversation alone
    (``metrics.evaluate_masked_documents``), with the unigram baseline of the rendered train conversations."""
    from megatron_kd_plugin.demo import qwen3_models
    from megatron_kd_plugin.demo.metrics import evaluate_masked_documents, unigram_perplexity

    models = {name: qwen3_models.load(folder) for name, folder in folders.items()}
    teacher = models.pop("teacher")
    metrics = evaluate_masked_documents(models, teacher, heldout.tokens, heldout.targets, heldout.files,
                                        pad_id=corpus.eod_id, micro_batch_size=cfg.heal.micro_batch_size,
                                        desc="evaluate (assistant tokens)")
    targets = torch.cat([ids[1:][mask[1:].bool()] for ids, mask in zip(heldout.tokens, heldout.targets)])
    train_tokens = data.token_windows(corpus.train_prefix, cfg.heal.seq_length).flatten()
    metrics["unigram"] = {"perplexity": unigram_perplexity(train_tokens, targets, corpus.vocab_size)}
    return metrics


def chat_rows(cfg: ChatConfig, store: pathlib.Path) -> dict:
    """``pipeline.row_figures`` of the packed store, its loss targets counted from the stored loss mask (the
    assistant's tokens), and ``masked_in``: their share of the rows' token slots."""
    from megatron_kd_plugin.cache.store import format as fmt

    loss_mask = np.asarray(fmt.open_group(store, mode="r")["loss_mask"][:])          # [N, S]
    return dict(row_figures(cfg.heal, store), loss_targets=int(loss_mask.sum()),
                masked_in=float(loss_mask.mean()))


def sweep_line(sweep: dict[str, dict], best: str) -> str:
    """The CE rate sweep in words."""
    rates = " / ".join(f"**{lr}**" if lr == best else lr for lr in sweep)
    perplexities = " / ".join(f"{m['perplexity']:.2f}" for m in sweep.values())
    kls = " / ".join(f"{m['kl_to_teacher']:.4f}" for m in sweep.values())
    return (f"The CE control's rate, swept on these rows: peak lr {rates} gave {TOKENS} perplexity {perplexities} "
            f"and KL {kls}; the best ({best}) is the CE heal above (chosen on this evaluation, which favours CE).")


def conversations_line(stats: dict, heldout: HeldoutConversations) -> str:
    return (f"Conversations: train {stats['train']['conversations']:,} from {stats['train']['files']:,} files, "
            f"held-out {stats['heldout']['conversations']:,} from {stats['heldout']['files']:,} files (dropped, "
            f"too long for a row: {stats['train']['dropped']:,} / {stats['heldout']['dropped']:,}); evaluated "
            f"{len(heldout.files):,} held-out conversations, each alone, from {len(set(heldout.files)):,} files.")


def run_chat_demo(cfg: ChatConfig, output: pathlib.Path, *, overwrite: bool = False) -> dict:
    """All stages into ``output``; returns what ``metrics.json`` holds. ``output`` and the corpus are checked
    before ``output`` is touched (FileExistsError, CorpusError), as in the main demo."""
    from megatron_kd_plugin.bridge.cpu_log import read_history

    heal = cfg.heal
    stage = StageClock()
    seconds = stage.seconds
    tokenized = start_run(cfg, output, overwrite, stage)
    output = output.resolve()
    commands = commands_file(output)
    tokenized.tokenizer.add_special_tokens(list(chat_data.CHAT_SPECIALS))
    text_corpus = tokenized.save(output / "data")
    chat = output / "chat"
    corpus, stats = stage("conversations", write_conversations, cfg, text_corpus, chat)
    teacher, pruned, store = output / "teacher", output / "student_pruned", output / "cache.zarr"
    teacher_history = stage("teacher", train_teacher, heal, corpus, teacher)
    params = stage("compress", compress_teacher, heal, corpus, teacher, pruned)
    stage("cache", run_command, cache_command(heal, corpus, teacher, store, data=chat / "train.jsonl",
                                              input_kind="messages"), output / "cache.log", commands,
          threads=max(1, (os.cpu_count() or 1) // heal.cache_tp))
    rows = chat_rows(cfg, store)
    runs = {"healed KD": ("heal_kd", heal.kd_alpha, heal.heal_lr)}
    runs.update({f"CE lr {lr:g}": (f"heal_ce_lr{lr:g}", 0.0, lr) for lr in cfg.ce_lrs})
    folders, histories = {"teacher": teacher, "pruned": pruned}, {}
    for name, (run, alpha, lr) in runs.items():
        stage(f"heal {name}", run_command, package_command("train", *heal_arguments(heal, pruned, store,
                                                                                     output / run, alpha=alpha,
                                                                                     lr=lr)),
              output / f"{run}.log", commands)
        folders[name] = exported_student(output / run, heal.heal_steps)
        histories[name] = read_history(output / run / "tb_logs")
    heldout = heldout_conversations(cfg, chat)
    metrics = stage("eval", evaluate_chat, cfg, corpus, heldout, folders)
    sweep = {f"{lr:g}": metrics.pop(f"CE lr {lr:g}") for lr in cfg.ce_lrs}
    best = min(sweep, key=lambda lr: sweep[lr]["perplexity"])
    metrics["healed CE"] = sweep[best]
    shutil.copytree(folders["healed KD"], output / "healed_kd")
    shutil.copytree(folders[f"CE lr {best}"], output / "healed_ce")
    histories = {"KD": histories["healed KD"], "CE": histories[f"CE lr {best}"]}
    (output / "history.json").write_text(json.dumps({"teacher": teacher_history, "heal_kd": histories["KD"],
                                                     "heal_ce": histories["CE"]}) + "\n")
    plot_results(metrics, histories, output / "results.png",
                 kd_label=f"forward KL to the teacher on assistant tokens, from its {heal.teacher_rows}")
    seconds["total"] = sum(seconds.values())
    shown = dataclasses.replace(heal, ce_lr=float(best))
    table = "\n".join([results_table(shown, metrics, params, seconds, text_corpus.stats, rows, tokens=TOKENS),
                       "", sweep_line(sweep, best), conversations_line(stats, heldout)])
    result = {"metrics": metrics, "outcome": outcome(metrics), "params": params, "seconds": seconds,
              "corpus": text_corpus.stats, "rows": rows, "conversations": stats, "ce_sweep": sweep, "ce_lr": best,
              "evaluated": {"conversations": len(heldout.files), "files": len(set(heldout.files))}}
    (output / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    (output / "results.md").write_text(table + "\n")
    result["table"] = table
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = demo_parser("python -m megatron_kd_plugin demo --chat", __doc__, "outputs/demo_chat", PRESETS)
    parser.add_argument("--layout", help="conversations are cached as packed rows only (the default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    preset = PRESETS[args.preset]
    changes = {name: value for name, value in (("seed", args.seed), ("teacher_steps", args.teacher_steps),
                                               ("heal_steps", args.heal_steps), ("layout", args.layout))
               if value is not None}
    try:
        corpus = dataclasses.replace(preset.heal.corpus, source=args.corpus, text_key=args.text_key,
                                     stdlib=args.stdlib)
        cfg = dataclasses.replace(preset, heal=dataclasses.replace(preset.heal, corpus=corpus, **changes))
        result = run_chat_demo(cfg, args.output, overwrite=args.overwrite)
    except STOPPED as error:
        return exit_code(error, args.output)
    print("\n" + result["table"])
    print(f"\n[demo] everything is in {args.output}/ (results.md, metrics.json, results.png, commands.sh, the "
          "conversations in chat/; the healed students as HF folders in healed_kd/ and healed_ce/)")
    return 0
