"""Data-mixture ablations without the teacher: cache once per domain, heal the same pruned student on
several blends of the two stores, compare each domain's held-out numbers.

    python -m megatron_kd_plugin demo --mixture [--output outputs/demo_mixture] [--preset default|mini] [--overwrite]
                                                [--seed N] [--blends 1:0 0.5:0.5 0:1]

Stages (everything under one output folder; the commands of stages 4-5 are the package's own, written to
``commands.sh``):

1. data      two domains of the running interpreter's stdlib ``*.py`` files (its test suites left out): **code**
             (each file without its docstrings) and **prose** (its docstrings: English); whole files go to train or
             held-out by name hash, so a held-out file is held out in both domains; one byte-level BPE tokenizer
             trained on both train splits; Megatron indexed datasets per domain and split, and both train splits
             together (the teacher's);
2. teacher   the main demo's Qwen3 teacher (``pipeline.train_teacher``) trained with cross entropy on both domains;
3. compress  pruned in depth and width as in the main demo (``pipeline.compress_teacher``);
4. cache     ``python -m megatron_kd_plugin cache ...`` once per domain: ``code.zarr``, ``prose.zarr``, each holding
             as many samples as a heal reads of one domain at most (the 1:0 blend reads only code);
5. heal      ``python -m megatron_kd_plugin train --recipe hf_student_kd_cpu_fp32_config ...
             dataset.blend='W_code code.zarr W_prose prose.zarr'`` once per blend, from the same pruned weights, with
             the same steps, schedule and seed: the teacher never runs again (a weight of 0 leaves its store out);
             each heal's log and ``history.jsonl`` show the KD loss of each domain (``kd loss [code]``, ...);
6. eval      every model by transformers on each domain's held-out text: perplexity and KL(teacher || model) over
             the full vocabulary (``metrics.json``, ``results.md``).

The table states the teacher forwards spent: one per cached sample, all in stage 4, none in a heal.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pathlib
import shutil
import sys

from megatron_kd_plugin.demo import data
from megatron_kd_plugin.demo.pipeline import PRESETS as PIPELINE_PRESETS
from megatron_kd_plugin.demo.pipeline import (
    HealConfig,
    compress_teacher,
    cache_command,
    exported_student,
    heal_arguments,
    package_command,
    run_command,
    train_teacher,
)
from megatron_kd_plugin.demo.stages import STOPPED, StageClock, exit_code, stage_lines

DOMAINS = ("code", "prose")
TEST_FOLDERS = {"test", "tests", "idle_test"}
"""Folders of the stdlib's own test suites, left out."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class MixtureConfig:
    """The ablation: the main demo's stages (``heal``: sizes, steps, learning rates) and what is mixed."""

    heal: HealConfig = dataclasses.replace(PIPELINE_PRESETS["default"], heal_steps=60, teacher_steps=400,
                                           eval_samples=64, layout="stream")
    """Teacher, compression, cache and heal settings (``pipeline.HealConfig``; its corpus: vocabulary and held-out
    share; the byte budgets below replace its own); the teacher steps, eval samples and stream layout the ablation
    was measured with (the main demo's steps and samples grew for issue #41, its layout became packed after; 512
    eval samples would not fit these held-out budgets)."""
    code_bytes: int = 1_200_000
    """Byte budget of the code domain's train split."""
    prose_bytes: int = 450_000
    """Byte budget of the prose domain's train split (the heals read ~250 KB of it)."""
    heldout_bytes: int = 50_000
    """Byte budget of each domain's held-out split."""
    heldout_every: int = 10
    """One file in ``heldout_every`` (by hash of its name) is held out, in both domains."""
    blends: tuple[tuple[float, float], ...] = ((1.0, 0.0), (0.5, 0.5), (0.0, 1.0))
    """(code weight, prose weight) of each heal."""

    def __post_init__(self):
        for name in ("code_bytes", "prose_bytes", "heldout_bytes", "heldout_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"MixtureConfig.{name} must be >= 1, got {getattr(self, name)}")
        for blend in self.blends:
            if len(blend) != 2 or min(blend) < 0 or not sum(blend) > 0:
                raise ValueError(f"blend {blend}: expected (code weight, prose weight), >= 0, not both 0")

    def budgets(self) -> dict[tuple[str, str], int]:
        """Bytes each (domain, split) takes."""
        return {("code", "train"): self.code_bytes, ("prose", "train"): self.prose_bytes,
                ("code", "heldout"): self.heldout_bytes, ("prose", "heldout"): self.heldout_bytes}


PRESETS = {
    "default": MixtureConfig(),
    # for tests: every stage at the main demo's mini sizes
    "mini": MixtureConfig(heal=dataclasses.replace(PIPELINE_PRESETS["mini"], layout="stream"), code_bytes=60_000, prose_bytes=40_000, heldout_bytes=20_000),
}


def split_domains(source: str) -> tuple[str, str] | None:
    """A Python file's (code without its docstrings, its docstrings joined by blank lines); None if it does not
    parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines, docstrings, dropped = source.splitlines(keepends=True), [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                docstrings.append(ast.get_docstring(node) or "")
                dropped.update(range(first.lineno - 1, first.end_lineno))
    code = "".join(line for number, line in enumerate(lines) if number not in dropped)
    return code, "\n\n".join(text for text in docstrings if text.strip())


def domain_documents(cfg: MixtureConfig) -> dict[tuple[str, str], list[data.Document]]:
    """{(domain, split): documents}: the stdlib files (not its test suites: little prose) in hash order, each split
    into its code and prose, whole files to train or held-out by name hash, until every (domain, split) holds its
    byte budget."""
    budgets = cfg.budgets()
    chosen = {key: [] for key in budgets}
    used = dict.fromkeys(budgets, 0)
    for document in data.stdlib_documents():
        if TEST_FOLDERS & set(pathlib.PurePosixPath(document.name).parts[:-1]):
            continue
        parts = split_domains(document.read())
        if parts is None:
            continue
        split = "heldout" if data.is_heldout(document.name, cfg.heldout_every) else "train"
        for domain, text in zip(DOMAINS, parts):
            size = len(text.encode("utf-8"))
            if size and used[domain, split] < budgets[domain, split]:
                chosen[domain, split].append(data.Document(name=document.name, size=size, text=text))
                used[domain, split] += size
        if all(used[key] >= budgets[key] for key in budgets):
            break
    return chosen


def make_data(cfg: MixtureConfig, folder: pathlib.Path) -> dict[str, data.DemoCorpus]:
    """Tokenizer and indexed datasets (stage 1): {"code": ..., "prose": ..., "both": ...} corpora sharing the
    tokenizer (``both``: the two train splits together, the teacher's); CorpusError when a split is too small."""
    documents = domain_documents(cfg)
    texts = {key: [doc.read() for doc in docs] for key, docs in documents.items()}
    train_texts = texts["code", "train"] + texts["prose", "train"]
    tokenizer = data.train_tokenizer(train_texts, cfg.heal.corpus.vocab_size)
    eod = tokenizer.token_to_id(data.EOD_TOKEN)
    tokens = {key: data.tokenize_documents(tokenizer, text, eod, desc=f"tokenize {key[0]} {key[1]}")
              for key, text in texts.items()}
    needs = {"train": cfg.heal.cache_samples * cfg.heal.seq_length + 1,
             "heldout": cfg.heal.eval_samples * cfg.heal.seq_length + 1}
    stats = {}
    for (domain, split), ids in tokens.items():
        count = sum(len(doc) for doc in ids)
        stats[f"{domain} {split}"] = dict(documents=len(ids), bytes=sum(d.size for d in documents[domain, split]),
                                          tokens=count)
        if count < needs[split]:
            raise data.CorpusError(f"the stdlib's {domain} {split} split holds {count:,} tokens, the mixture demo "
                                   f"needs {needs[split]:,}; raise its byte budget")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_path = folder / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    for (domain, split), ids in tokens.items():
        data.write_indexed_dataset(folder / f"{domain}_{split}", ids)
    both = sorted(zip(documents["code", "train"] + documents["prose", "train"],
                      tokens["code", "train"] + tokens["prose", "train"]), key=lambda pair: pair[0].name)
    data.write_indexed_dataset(folder / "both_train", [ids for _, ids in both])
    common = dict(folder=folder, tokenizer_path=tokenizer_path, vocab_size=tokenizer.get_vocab_size(), eod_id=eod,
                  stats=stats)
    (folder / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return {name: data.DemoCorpus(train_prefix=folder / f"{name}_train",
                                  heldout_prefix=folder / f"{'code' if name == 'both' else name}_heldout", **common)
            for name in (*DOMAINS, "both")}


def blend_name(blend: tuple[float, float]) -> str:
    return f"{blend[0]:g}:{blend[1]:g}"


def blend_override(blend: tuple[float, float], stores: dict[str, pathlib.Path]) -> str:
    """``dataset.blend=W code.zarr W prose.zarr`` (Megatron's syntax, one argument), stores of weight 0 left out."""
    return "dataset.blend=" + " ".join(f"{weight:g} {stores[domain]}" for domain, weight in zip(DOMAINS, blend)
                                       if weight > 0)


def heal_command(cfg: MixtureConfig, pruned: pathlib.Path, stores: dict[str, pathlib.Path], run_dir: pathlib.Path,
                 blend: tuple[float, float]) -> list[str]:
    """The main demo's KD heal (``pipeline.heal_arguments``) reading the blend instead of one store."""
    arguments = heal_arguments(cfg.heal, pruned, stores["code"], run_dir, alpha=cfg.heal.kd_alpha, lr=cfg.heal.heal_lr)
    arguments = [arg for arg in arguments if not arg.startswith("dataset.cache_path=")]
    return package_command("train", *arguments, blend_override(blend, stores))


def evaluate_domains(cfg: MixtureConfig, corpora: dict[str, data.DemoCorpus],
                     folders: dict[str, pathlib.Path]) -> dict[str, dict[str, dict[str, float]]]:
    """{domain: {model: metrics}}: every model by transformers on the domain's held-out windows."""
    import torch

    from megatron_kd_plugin.demo import qwen3_models
    from megatron_kd_plugin.demo.metrics import evaluate, hf_logits

    models = {name: qwen3_models.load(folder) for name, folder in folders.items()}
    teacher = models.pop("teacher")
    with torch.no_grad():
        return {domain: evaluate(models, teacher, data.token_windows(corpora[domain].heldout_prefix,
                                                                      cfg.heal.seq_length,
                                                                      max_samples=cfg.heal.eval_samples),
                                 micro_batch_size=cfg.heal.micro_batch_size, desc=f"eval {domain}",
                                 logits_fn=hf_logits)
                for domain in DOMAINS}


def results_table(cfg: MixtureConfig, metrics: dict, forwards: dict[str, int], seconds: dict[str, float]) -> str:
    """The markdown table: one row per model, each domain's held-out perplexity and KL, the teacher forwards."""
    cached = sum(forwards.values())
    lines = ["| model | code: held-out ppl | code: KL(teacher ‖ model) | prose: held-out ppl | prose: KL | "
             "teacher forwards |", "|---|---:|---:|---:|---:|---:|"]
    for name in metrics["code"]:
        spent = (f"{cached:,} (cache: {forwards['code']:,} code + {forwards['prose']:,} prose samples)"
                 if name == "teacher" else "0" if name.startswith("healed") else "")
        cells = [f"{metrics[d][name]['perplexity']:.3f} | {metrics[d][name]['kl_to_teacher']:.4f}" for d in DOMAINS]
        lines.append(f"| {name} | {' | '.join(cells)} | {spent} |")
    heals = len(cfg.blends)
    lines += ["", f"{heals} heals of {cfg.heal.heal_steps} steps x {cfg.heal.micro_batch_size} rows of "
                  f"{cfg.heal.seq_length} tokens (alpha {cfg.heal.kd_alpha}, {cfg.heal.kd_tail} tail, lr "
                  f"{cfg.heal.heal_lr:g}, {cfg.heal.teacher_rows}) from the same pruned student; the teacher ran "
                  f"{cached:,} sample forwards, once, for the two caches; a heal runs it "
                  f"never (a teacher run per heal would have been {heals} x {cfg.heal.cache_samples:,} = "
                  f"{heals * cfg.heal.cache_samples:,} sample forwards for these {heals} blends, and one more per "
                  "further blend)."]
    return "\n".join(lines + stage_lines(seconds))


def run(cfg: MixtureConfig, output: pathlib.Path, *, overwrite: bool = False) -> dict:
    """Every stage into ``output``; returns {"metrics", "forwards", "histories", "seconds"}."""
    from megatron_kd_plugin.bridge.cpu_log import read_history
    from megatron_kd_plugin.demo.scratch import check_output, prepare_output

    check_output(output, overwrite)
    stage = StageClock()
    prepare_output(output, overwrite)
    output = output.resolve()
    (output / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    commands = output / "commands.sh"
    commands.write_text("# the package commands the demo ran, in order (python = the demo's interpreter)\n")
    corpora = stage("data", make_data, cfg, output / "data")
    teacher, pruned = output / "teacher", output / "student_pruned"
    stage("teacher", train_teacher, cfg.heal, corpora["both"], teacher)
    stage("compress", compress_teacher, cfg.heal, corpora["both"], teacher, pruned)
    stores = {domain: output / f"{domain}.zarr" for domain in DOMAINS}
    threads = max(1, (os.cpu_count() or 1) // cfg.heal.cache_tp)
    for domain in DOMAINS:
        stage(f"cache {domain}", run_command, cache_command(cfg.heal, corpora[domain], teacher, stores[domain]),
              output / f"cache_{domain}.log", commands, threads=threads)
    forwards = {domain: cfg.heal.cache_samples for domain in DOMAINS}
    folders, histories = {"teacher": teacher, "pruned": pruned}, {}
    for blend in cfg.blends:
        name = blend_name(blend)
        run_dir = output / f"heal_{name.replace(':', '_')}"
        stage(f"heal {name}", run_command, heal_command(cfg, pruned, stores, run_dir, blend),
              output / f"heal_{name.replace(':', '_')}.log", commands)
        folders[f"healed on code:prose {name}"] = output / f"healed_{name.replace(':', '_')}"
        shutil.copytree(exported_student(run_dir, cfg.heal.heal_steps), folders[f"healed on code:prose {name}"])
        histories[name] = read_history(run_dir / "tb_logs")
    metrics = stage("eval", evaluate_domains, cfg, corpora, folders)
    stage.seconds["total"] = sum(stage.seconds.values())
    result = {"metrics": metrics, "forwards": forwards, "histories": histories, "seconds": stage.seconds}
    (output / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    (output / "results.md").write_text(results_table(cfg, metrics, forwards, stage.seconds) + "\n")
    return result


def blend_argument(text: str) -> tuple[float, float]:
    try:
        code, prose = (float(value) for value in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--blends {text!r}: expected CODE:PROSE weights, e.g. 0.5:0.5") from None
    return code, prose


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_kd_plugin demo --mixture", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("outputs/demo_mixture"))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--seed", type=int, help="override the preset's seed")
    parser.add_argument("--blends", type=blend_argument, nargs="+", metavar="CODE:PROSE",
                        help="the heals' blends (default: 1:0 0.5:0.5 0:1)")
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset]
    try:
        if args.seed is not None:
            cfg = dataclasses.replace(cfg, heal=dataclasses.replace(cfg.heal, seed=args.seed))
        if args.blends:
            cfg = dataclasses.replace(cfg, blends=tuple(args.blends))
        result = run(cfg, args.output, overwrite=args.overwrite)
    except STOPPED as error:
        return exit_code(error, args.output)
    print("\n" + results_table(cfg, result["metrics"], result["forwards"], result["seconds"]))
    print(f"\n[demo] everything is in {args.output}/ (results.md, metrics.json, commands.sh)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
