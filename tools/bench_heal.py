"""Heal sweeps on a finished heal demo: its pruned student healed again under other settings, by the package's own
train command, and every healed student evaluated by the demo's own metrics; one table.

    python -m megatron_kd_plugin demo --seed 7 --output outputs/demo_7          # once per seed
    python tools/bench_heal.py outputs/demo_7 --output bench_results/heal_7 \\
        --store top100="--topk 100" --store topp0.9="--top-p 0.9" \\
        "kd.alpha=0" "kd.alpha=0 lr=1e-3" "lr=3e-4" "steps=200" \\
        "store=top100 kd.tail=renorm" "store=topp0.9 kd.tail=renorm"

Each positional argument is one heal: space-separated words, each either

    lr=X          peak learning rate: optimizer.lr=X optimizer.min_lr=X/10 (default: the demo's heal_lr)
    steps=N       optimizer steps, with the demo's warm-up (N/10), logging and final checkpoint (default: the demo's)
    samples=N     cached samples the heal reads (default steps x micro-batch: one epoch, as in the demo; fewer: more
                  epochs over them)
    store=NAME    ``demo`` (default: the demo's own store kind, ``cache_selection``) or a ``--store`` name; a heal
                  on a store of another kind than the demo's gives its tail (``kd.tail=...``: the demo's own is
                  passed otherwise), or is refused before anything runs
    KEY=VALUE     any train override (``kd.*``, ``optimizer.*``, ``train.*``, ...), appended after the demo's own

The heal is the demo's KD heal (``pipeline.heal_arguments``: the demo's recipe, pruned student, seed, batch,
schedule, ``kd.alpha`` and ``kd.tail``, from the folder's ``config.json``) with these words applied, run as ``python
-m megatron_kd_plugin train ...`` into ``OUTPUT/runs/<heal>/``; its exported HF student is evaluated against the
demo's teacher on the demo's held-out tokens (``pipeline.evaluate_folders``: perplexity, KL(teacher ‖ student) over
the full vocabulary). ``--store NAME="ARGS"``: a store written by the package's cache command from the demo's
teacher with ARGS in place of the demo's selection (a top-p store keeps ``--topk K`` as its cap), one per number of
samples, under ``OUTPUT/stores/``; the ``demo`` store of the demo's own samples is the demo's ``cache.zarr``. A heal
whose result is in ``OUTPUT/runs/<heal>/result.json`` is not run again. A heal the train command refuses, or that
fails, is a row saying so; a warning the train command printed before step one is shown under the table.

Columns: bytes per token of the store on disk (as ``python -m megatron_kd_plugin inspect STORE`` counts them), held-out
perplexity and KL, and the share of what pruning cost that the heal won back: (pruned - healed) / (pruned -
teacher), in perplexity and in KL (the teacher's KL is 0). The table also goes to ``OUTPUT/results.md`` and every
row to ``OUTPUT/results.json``. The quality numbers depend on the thread count (``OMP_NUM_THREADS``, recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

KEYS = ("lr", "steps", "samples", "store")
"""The heal words that are not train overrides."""


@dataclasses.dataclass(frozen=True)
class Heal:
    """One heal: its words as given, the tool's own keys parsed, the train overrides in order."""

    name: str
    lr: float | None
    steps: int | None
    samples: int | None
    store: str
    overrides: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, stores: dict[str, list[str]]) -> "Heal":
        words = text.split()
        if not words or any("=" not in word for word in words):
            raise ValueError(f"heal {text!r}: expected space-separated KEY=VALUE words")
        keys = {}
        for word in words:
            key, value = word.split("=", 1)
            if key in KEYS:
                keys[key] = value
        store = keys.get("store", "demo")
        if store != "demo" and store not in stores:
            raise ValueError(f"heal {text!r}: store={store} is neither demo nor a --store name ({sorted(stores)})")
        return cls(name=" ".join(words), lr=float(keys["lr"]) if "lr" in keys else None,
                   steps=int(keys["steps"]) if "steps" in keys else None,
                   samples=int(keys["samples"]) if "samples" in keys else None, store=store,
                   overrides=tuple(w for w in words if w.split("=", 1)[0] not in KEYS))

    @property
    def folder(self) -> str:
        """The heal's run folder name: its words, joined by ``__``, ``=`` and anything unusual as ``_`` (Bridge's
        overrides cannot hold a ``=`` in a path)."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.name.replace(" ", "__"))


def check_store_tail(demo_cfg, heal: Heal, stores: dict[str, list[str]]) -> None:
    """ValueError (one line) if the heal's tail does not fit the kind of store it reads: its last ``kd.tail=`` word,
    else the demo's own ``kd_tail``; a store of draws takes ``sampled``, a top-K or top-p store another tail."""
    drawn = demo_cfg.draws > 0 if heal.store == "demo" else "--draws" in stores[heal.store]
    tails = [word.split("=", 1)[1] for word in heal.overrides if word.startswith("kd.tail=")]
    tail = tails[-1] if tails else demo_cfg.kd_tail
    if drawn != (tail == "sampled"):
        wanted = "kd.tail=sampled" if drawn else "kd.tail=renorm (or ghost)"
        raise ValueError(f"heal {heal.name!r}: store={heal.store} holds {'draws' if drawn else 'a top-K'} and the "
                         f"heal's tail is {tail!r} (the demo's, unless a kd.tail= word is given): add {wanted}")


def heal_config(demo_cfg, heal: Heal):
    """The demo's HealConfig with the heal's steps and learning rate."""
    return dataclasses.replace(demo_cfg, heal_steps=heal.steps or demo_cfg.heal_steps,
                               heal_lr=demo_cfg.heal_lr if heal.lr is None else heal.lr)


def store_path(demo: pathlib.Path, output: pathlib.Path, demo_cfg, name: str, samples: int,
               stores: dict[str, list[str]], corpus, log: pathlib.Path) -> pathlib.Path:
    """The store ``name`` holding ``samples`` samples, written by the cache command unless it is complete."""
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.demo.pipeline import cache_command, run_command

    if name == "demo" and samples == demo_cfg.cache_samples:
        return demo / "cache.zarr"
    path = output / "stores" / f"{name}-{samples}.zarr"
    try:
        TopKCacheReader(path)
        return path
    except ValueError:                                        # absent or unfinished: the cache command (re)writes it
        pass
    if samples % demo_cfg.micro_batch_size:
        raise ValueError(f"samples={samples}: expected a multiple of the micro-batch {demo_cfg.micro_batch_size}")
    cfg = dataclasses.replace(demo_cfg, heal_steps=samples // demo_cfg.micro_batch_size)   # cache_samples = samples
    path.parent.mkdir(parents=True, exist_ok=True)
    run_command(cache_command(cfg, corpus, demo / "teacher", path, stores.get(name)), log,
                output / "commands.sh")
    return path


def bytes_per_token(store: pathlib.Path) -> float:
    """The store's bytes on disk per cached token (``inspect``'s count: zarr temporaries left out)."""
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.commands.inspect import stored_bytes

    spec = TopKCacheReader(store).spec
    return sum(stored_bytes(store).values()) / (spec.num_samples * spec.seq_length)


def run_heal(demo: pathlib.Path, output: pathlib.Path, demo_cfg, corpus, heal: Heal,
             stores: dict[str, list[str]]) -> dict:
    """Runs and evaluates one heal (or reads its earlier result); returns its row."""
    import os
    import shutil

    import torch

    from megatron_kd_plugin.demo.pipeline import (
        evaluate_folders,
        exported_student,
        heal_arguments,
        package_command,
        run_command,
    )

    run_dir = output / "runs" / heal.folder
    result = run_dir / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    cfg = heal_config(demo_cfg, heal)
    samples = heal.samples or cfg.cache_samples
    store = store_path(demo, output, demo_cfg, heal.store, samples, stores, corpus, output / f"cache_{heal.store}.log")
    if run_dir.exists():
        shutil.rmtree(run_dir)                                 # an unfinished heal: start it again
    run_dir.mkdir(parents=True)
    row = dict(heal=heal.name, store=heal.store, samples=samples, bytes_per_token=bytes_per_token(store),
               steps=cfg.heal_steps, lr=cfg.heal_lr, threads=os.environ.get("OMP_NUM_THREADS", "unset"))
    command = package_command("train", *heal_arguments(cfg, demo / "student_pruned", store, run_dir,
                                                         alpha=demo_cfg.kd_alpha, lr=cfg.heal_lr), *heal.overrides)
    log = run_dir / "train.log"
    start = time.perf_counter()
    try:
        run_command(command, log, output / "commands.sh")
    except subprocess.CalledProcessError as error:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        row.update(failed=f"exit {error.returncode}: {lines[-1] if lines else ''}")
    row.update(seconds=time.perf_counter() - start, warnings=warnings_before_step_one(log))
    if "failed" not in row:
        metrics = evaluate_folders(cfg, corpus, {"teacher": demo / "teacher",
                                                 "healed": exported_student(run_dir, cfg.heal_steps)})
        row.update(metrics["healed"], torch_threads=torch.get_num_threads())
        shutil.rmtree(run_dir / "checkpoints")                 # the evaluated student is not kept (a few MB each)
    result.write_text(json.dumps(row, indent=1) + "\n")
    return row


def warnings_before_step_one(log: pathlib.Path) -> list[str]:
    """The ``UserWarning`` lines the train command printed before its first logged iteration."""
    found = []
    for line in log.read_text().splitlines():
        if " iteration " in line:
            break
        if "UserWarning: kd." in line:
            found.append(line.split("UserWarning: ", 1)[1])
    return found


def base_metrics(demo: pathlib.Path, output: pathlib.Path, demo_cfg, corpus) -> dict:
    """The teacher's and the pruned student's metrics (``OUTPUT/base.json``, evaluated once)."""
    from megatron_kd_plugin.demo.pipeline import evaluate_folders

    path = output / "base.json"
    if not path.exists():
        metrics = evaluate_folders(demo_cfg, corpus, {"teacher": demo / "teacher", "pruned": demo / "student_pruned"})
        path.write_text(json.dumps(metrics, indent=1) + "\n")
    return json.loads(path.read_text())


def table(base: dict, rows: list[dict]) -> str:
    """Markdown: the teacher and the pruned student, then one row per heal."""
    from megatron_kd_plugin.demo.pipeline import won_back

    teacher, pruned = base["teacher"], base["pruned"]
    out = ["| heal | store B/token | held-out ppl | KL(teacher ‖ student) | ppl won back | KL won back | train s |",
           "|---|---:|---:|---:|---:|---:|---:|",
           f"| (teacher) | | {teacher['perplexity']:.3f} | 0 | | | |",
           f"| (pruned, before healing) | | {pruned['perplexity']:.3f} | {pruned['kl_to_teacher']:.4f} | 0% | 0% | |"]
    for r in rows:
        mark = " (warned)" if r["warnings"] else ""
        if "failed" in r:
            out.append(f"| `{r['heal']}`{mark} | {r['bytes_per_token']:.1f} | refused or failed: "
                       f"{r['failed'].replace('|', '/')} | | | | {r['seconds']:.0f} |")
            continue
        won_ppl, won_kl = won_back(dict(base, healed=r), "healed")
        out.append(f"| `{r['heal']}`{mark} | {r['bytes_per_token']:.1f} | {r['perplexity']:.3f} | "
                   f"{r['kl_to_teacher']:.4f} | {won_ppl:.0%} | {won_kl:.0%} | {r['seconds']:.0f} |")
    warned = {w for r in rows for w in r["warnings"]}
    out += [f"\nwarned before step one: {w}" for w in sorted(warned)]
    return "\n".join(out)


def parse_store(text: str) -> tuple[str, list[str]]:
    name, _, args = text.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name == "demo" or not args.split():
        raise argparse.ArgumentTypeError(f"--store {text!r}: expected NAME=\"CACHE ARGS\" (NAME not demo)")
    return name, args.split()


def main(argv: list[str] | None = None) -> int:
    from megatron_kd_plugin.demo.data import DemoCorpus
    from megatron_kd_plugin.demo.pipeline import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo", type=pathlib.Path, help="a finished `python -m megatron_kd_plugin demo` folder")
    parser.add_argument("heals", nargs="+", help="one heal each (see above)")
    parser.add_argument("--output", type=pathlib.Path, help="default: DEMO/bench_heal")
    parser.add_argument("--store", type=parse_store, action="append", default=[], metavar='NAME="ARGS"')
    args = parser.parse_args(argv)
    demo = args.demo.resolve()
    if not (demo / "student_pruned" / "config.json").is_file() or not (demo / "cache.zarr").is_dir():
        parser.error(f"{args.demo}: not a finished heal demo folder (no student_pruned/ or cache.zarr)")
    stores, demo_cfg = dict(args.store), load_config(demo)
    try:
        heals = [Heal.parse(text, stores) for text in args.heals]
        for heal in heals:
            check_store_tail(demo_cfg, heal, stores)
    except ValueError as error:
        parser.error(str(error))
    output = (args.output or demo / "bench_heal").resolve()
    output.mkdir(parents=True, exist_ok=True)
    corpus = DemoCorpus.load(demo / "data")
    base = base_metrics(demo, output, demo_cfg, corpus)
    rows = []
    for heal in heals:
        print(f"[bench_heal] {heal.name}", flush=True)
        rows.append(run_heal(demo, output, demo_cfg, corpus, heal, stores))
    text = table(base, rows)
    (output / "results.md").write_text(text + "\n")
    (output / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n" + text + f"\n\n[bench_heal] {output / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
