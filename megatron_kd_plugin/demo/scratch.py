"""The from-scratch comparison (the first demo, kept for ``tools/bench_quality.py`` and its published numbers): a
small megatron-core GPT teacher distilled through the offline top-K cache into a *randomly initialised* smaller
student, against the same student trained with hard labels only. The main demo heals a compressed Hugging Face
model instead (``megatron_kd_plugin.demo.pipeline``).

    python -m megatron_kd_plugin demo --from-scratch [--output outputs/demo_scratch] [--preset default|small|mini]
                                      [--overwrite] [--corpus FOLDER_OR_JSONL [--text-key text]]

Stages (all on CPU; everything lands under one output folder):

1. data      the running interpreter's stdlib sources, or with ``--corpus`` a folder of text files (one document
             each) or a JSONL file (one document per line), split by whole document; a BPE tokenizer trained on
             the train split; Megatron indexed datasets (``data/``, see ``megatron_kd_plugin.demo.data``);
2. teacher   a megatron-core GPTModel (``megatron_kd_plugin.models.gpt``) trained with cross entropy in this process
             (TP=1), saved with ``save_gpt`` (``teacher/``);
3. cache     its top-K (default 100) over the student's training samples, by the cache command
             (``torchrun --nproc_per_node 2 -m megatron_kd_plugin cache``) at TP=2 (``cache.zarr``);
4. students  two students of the same architecture, steps, batches, learning-rate schedule and seed, both
             trained by the Megatron-Bridge CPU path (the tiny KD recipe + ``train_on_cpu`` + the fused loss):
             ``kd`` on the cache (forward KL, ghost tail, mixed with hard labels at ``kd_alpha``) and
             ``ce`` on the same tokens with hard labels only (alpha = 0);
5. eval      held-out perplexity, KL(teacher ‖ model) over the full vocabulary and ECE, dense, for the teacher
             and both students (``metrics.json``, ``results.md``), loss curves (``loss_curves.png``).

The folder must not exist (or be empty) unless ``--overwrite`` is given; a corpus that cannot make the data
(missing, no text, too little for the sizes) is refused before the folder is touched. The same seed gives the
same numbers on the same machine and package set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import torch

from megatron_kd_plugin.demo.data import CorpusConfig, DemoCorpus, padded_vocab_size, token_windows, tokenize_corpus
from megatron_kd_plugin.demo.stages import STOPPED, StageClock, add_corpus_arguments, exit_code, stage_lines

STUDENT_RECIPE = "tiny_gpt_kd_cpu_fp32_config"


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelSize:
    """A GPT's shape (the rest of the architecture is ``megatron_kd_plugin.models.gpt``'s / the recipe's default)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Attention heads (divisible by the TP size)."""
    ffn_hidden_size: int
    """MLP width."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class DemoConfig:
    """Everything the demo does; ``PRESETS`` holds the tested sizes."""

    seed: int = 1234
    """Seed of every random choice (initialisation, batch order)."""
    corpus: CorpusConfig = CorpusConfig()
    """The text (the stdlib sources unless ``corpus.source``), its splits and its tokenizer."""
    seq_length: int = 256
    """Tokens per sample, for the teacher, the cache and the students."""
    teacher: ModelSize = ModelSize(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024)
    """Teacher shape."""
    student: ModelSize = ModelSize(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512)
    """Student shape (both students)."""
    teacher_steps: int = 300
    """Teacher optimizer steps."""
    student_steps: int = 150
    """Optimizer steps of each student (the budget both students share)."""
    micro_batch_size: int = 8
    """Samples per step, teacher and students."""
    teacher_lr: float = 3e-3
    """Teacher peak learning rate."""
    student_lr: float = 3e-3
    """Students' learning rate (the tiny CPU recipe's schedule: warm-up, then constant)."""
    topk: int = 100
    """Teacher top-K cached per token."""
    kd_alpha: float = 0.5
    """The KD student's loss: kd_alpha * KD + (1 - kd_alpha) * CE. With a small, high-entropy teacher the top-100
    holds only ~3/4 of its mass; the hard labels then shape the student's tail (alpha = 1 leaves it unshaped)."""
    cache_tp: int = 2
    """Tensor-parallel size (= processes) of the caching run."""
    eval_samples: int = 32
    """Held-out samples evaluated (each ``seq_length`` tokens)."""

    def __post_init__(self):
        for name in ("seq_length", "teacher_steps", "student_steps", "micro_batch_size", "topk", "cache_tp",
                     "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.kd_alpha <= 1:
            raise ValueError(f"DemoConfig.kd_alpha must be in (0, 1], got {self.kd_alpha}")

    @property
    def cache_samples(self) -> int:
        """Samples the students consume: one epoch of cached samples, nothing cached in vain."""
        return self.student_steps * self.micro_batch_size

    def corpus_needs(self) -> dict[str, tuple[int, str]]:
        """Tokens each split must hold, and why: the cache reads ``cache_samples`` windows of the train split,
        the eval ``eval_samples`` windows of the held-out one (windows overlap by one token)."""
        return {"train": (self.cache_samples * self.seq_length + 1,
                          f"{self.cache_samples:,} cached samples = {self.student_steps} student steps x "
                          f"{self.micro_batch_size} per batch, of {self.seq_length} tokens, + 1; or lower "
                          "--student-steps"),
                "heldout": (self.eval_samples * self.seq_length + 1,
                            f"{self.eval_samples} eval samples of {self.seq_length} tokens + 1; the held-out "
                            f"split takes one document in {self.corpus.heldout_every}")}


PRESETS = {
    "default": DemoConfig(),
    # the quality benchmark's size (docs/benchmarks.md). A 512-id vocabulary and 1,200 teacher steps give a teacher as
    # confident as a large LM is over its own vocabulary (~98% of its held-out mass in its top-100); the top-K
    # route's gap to dense KD grows with the mass outside the top-K (docs/benchmarks.md)
    "small": DemoConfig(
        corpus=CorpusConfig(vocab_size=512, train_bytes=3_000_000, heldout_bytes=400_000),
        seq_length=128,
        teacher=ModelSize(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512),
        student=ModelSize(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256),
        teacher_steps=1200, student_steps=100, micro_batch_size=8, eval_samples=256),
    # seconds, for tests: same stages, toy sizes
    "mini": DemoConfig(
        corpus=CorpusConfig(vocab_size=512, train_bytes=150_000, heldout_bytes=30_000),
        seq_length=32,
        teacher=ModelSize(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128),
        student=ModelSize(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
        teacher_steps=20, student_steps=10, micro_batch_size=4, topk=16, eval_samples=4),
}


def _output_in_use(folder: pathlib.Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def check_output(folder: pathlib.Path, overwrite: bool) -> None:
    """FileExistsError if ``folder`` holds anything and ``overwrite`` is off; touches nothing."""
    if _output_in_use(folder) and not overwrite:
        raise FileExistsError(f"output folder {folder} already exists and is not empty: pass --overwrite to "
                              "replace it, or choose another --output")


def prepare_output(folder: pathlib.Path, overwrite: bool) -> None:
    """Creates ``folder``; an existing non-empty one is an error unless ``overwrite`` (then it is emptied)."""
    check_output(folder, overwrite)
    if _output_in_use(folder):
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    folder.mkdir(parents=True, exist_ok=True)


def _gpt_spec(size: ModelSize, cfg: DemoConfig, vocab_size: int):
    from megatron_kd_plugin.models.gpt import GPTSpec

    return GPTSpec(**dataclasses.asdict(size), vocab_size=vocab_size, seq_length=cfg.seq_length)


def train_teacher(cfg: DemoConfig, corpus: DemoCorpus, folder: pathlib.Path):
    """Trains the teacher with cross entropy on the train split (this process, TP=1); saves it to ``folder``."""
    from megatron_kd_plugin.demo.teacher_training import TrainConfig, ce_step, micro_batches, train
    from megatron_kd_plugin.models.gpt import build_gpt, save_gpt

    spec = _gpt_spec(cfg.teacher, cfg, padded_vocab_size(corpus.vocab_size))
    model = build_gpt(spec, tp_size=1)
    samples = token_windows(corpus.train_prefix, cfg.seq_length)
    train_cfg = TrainConfig(steps=cfg.teacher_steps, micro_batch_size=cfg.micro_batch_size, lr=cfg.teacher_lr)
    history = train(model, ce_step(model, samples, micro_batches(samples, cfg.micro_batch_size, cfg.seed)),
                    train_cfg, desc="teacher (CE)")
    save_gpt(model, spec, folder)
    return model, history


def cache_teacher(cfg: DemoConfig, corpus: DemoCorpus, teacher: pathlib.Path, store: pathlib.Path, *,
                  sample: int | None = None, proposal_temperature: float = 1.0, top_p: float | None = None,
                  head: int | None = None) -> None:
    """Runs the cache command (``python -m megatron_kd_plugin cache`` through torchrun's ``-m``: the package as this
    environment imports it, installed or not) at TP = ``cfg.cache_tp`` on the first ``cfg.cache_samples`` samples:
    the teacher's top-``cfg.topk``, or with ``sample`` that many ids drawn per token from the teacher at
    ``proposal_temperature`` (a sampled store; after the exact top-``head`` with ``head``), or with ``top_p`` a top-p
    store capped at ``cfg.topk``."""
    mode = (["--topk", str(cfg.topk)] if sample is None
            else ["--draws", str(sample), "--proposal-temperature", str(proposal_temperature)])
    mode += [] if head is None else ["--head", str(head)]
    mode += [] if top_p is None else ["--top-p", str(top_p)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.cache_tp}",
               "-m", "megatron_kd_plugin", "cache", "--teacher", str(teacher), "--data", str(corpus.train_prefix),
               "--tokenizer", str(corpus.tokenizer_path), "--output", str(store),
               "--seq-length", str(cfg.seq_length), *mode, "--tp", str(cfg.cache_tp),
               "--num-samples", str(cfg.cache_samples), "--micro-batch-size", str(cfg.micro_batch_size)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // cfg.cache_tp)))
    print("[demo] " + " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, env=env)


def student_overrides(cfg: DemoConfig, store: pathlib.Path, vocab_size: int, run_dir: pathlib.Path, *,
                      alpha: float) -> list[str]:
    """Bridge overrides that turn the tiny CPU KD recipe into one demo student (``alpha=0``: hard labels only)."""
    s = cfg.student
    return [f"model.num_layers={s.num_layers}", f"model.hidden_size={s.hidden_size}",
            f"model.num_attention_heads={s.num_attention_heads}", f"model.ffn_hidden_size={s.ffn_hidden_size}",
            f"model.vocab_size={vocab_size}", f"model.seq_length={cfg.seq_length}",
            f"dataset.cache_path={store}", f"dataset.seq_length={cfg.seq_length}", f"dataset.seed={cfg.seed}",
            "dataset.num_workers=0",
            f"train.train_iters={cfg.student_steps}", f"train.global_batch_size={cfg.micro_batch_size}",
            f"train.micro_batch_size={cfg.micro_batch_size}",
            f"optimizer.lr={cfg.student_lr}",   # the recipe keeps it constant after the warm-up
            f"scheduler.lr_warmup_iters={min(10, cfg.student_steps // 2)}",
            f"kd.alpha={alpha}", f"rng.seed={cfg.seed}",
            f"logger.tensorboard_dir={run_dir / 'tb_logs'}", f"logger.log_interval={max(1, cfg.student_steps // 10)}",
            f"checkpoint.save={run_dir / 'checkpoints'}"]


def train_student(cfg: DemoConfig, store: pathlib.Path, vocab_size: int, run_dir: pathlib.Path, *, alpha: float):
    """One student through the recipe + CPU loop (this process, TP=1); returns (model, history)."""
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.commands.train import build_config   # recipe + overrides, exactly as the train command

    config = build_config(STUDENT_RECIPE, student_overrides(cfg, store, vocab_size, run_dir, alpha=alpha))
    models, history = train_on_cpu(config)
    return models[0], history


def draw_curves(ax, title: str, curves: dict[str, list[float]]) -> None:
    """One panel of {line: values per step}: raw values faint, a moving average solid."""
    for name, values in curves.items():
        y = torch.tensor(values, dtype=torch.float64)
        window = max(1, min(10, len(y) // 5))
        smooth = torch.nn.functional.avg_pool1d(y[None, None], window, stride=1).flatten()
        (raw,) = ax.plot(range(len(y)), y.numpy(), alpha=0.25)
        ax.plot(range(window - 1, len(y)), smooth.numpy(), label=name, color=raw.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("nats/token")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)


def plot_curves(panels: dict[str, dict[str, list[float]]], path: pathlib.Path) -> None:
    """Training-loss curves, one panel per {title: {line: values}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels.items()):
        draw_curves(ax, title, curves)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_table(metrics: dict[str, dict[str, float]], seconds: dict[str, float]) -> str:
    """The final table (markdown): held-out perplexity, KL(teacher ‖ model), ECE, then stage times."""
    lines = ["| model | held-out perplexity | KL(teacher ‖ model) nats/token | ECE |", "|---|---:|---:|---:|"]
    for name, m in metrics.items():
        lines.append(f"| {name} | {m['perplexity']:.3f} | {m['kl_to_teacher']:.4f} | {m['ece']:.4f} |")
    lines += stage_lines(seconds)
    return "\n".join(lines)


def start_run(cfg, output: pathlib.Path, overwrite: bool, stage: StageClock):
    """A demo's first steps: ``output`` checked, the corpus tokenized (stage "data"; both before ``output`` is
    touched), then ``output`` prepared and ``cfg`` written to its config.json; the tokenized corpus."""
    check_output(output, overwrite)
    tokenized = stage("data", tokenize_corpus, cfg.corpus, cfg.corpus_needs())
    prepare_output(output, overwrite)
    (output / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    return tokenized


def run_demo(cfg: DemoConfig, output: pathlib.Path, *, overwrite: bool = False) -> dict:
    """All stages into ``output``; returns {"metrics": ..., "seconds": ...}.

    ``output`` is refused (FileExistsError) if it holds anything and ``overwrite`` is off, and the corpus
    (CorpusError) if it cannot make the data; both before ``output`` is touched.
    """
    from megatron_kd_plugin.demo.metrics import evaluate
    from megatron_kd_plugin.demo.teacher_training import single_process_megatron

    stage = StageClock()
    seconds = stage.seconds

    tokenized = start_run(cfg, output, overwrite, stage)
    corpus = tokenized.save(output / "data")
    vocab = padded_vocab_size(corpus.vocab_size)
    store = output / "cache.zarr"
    with single_process_megatron(cfg.seed):
        teacher, teacher_history = stage("teacher", train_teacher, cfg, corpus, output / "teacher")
        stage("cache", cache_teacher, cfg, corpus, output / "teacher", store)
        kd, kd_history = stage("student kd", train_student, cfg, store, vocab, output / "student_kd",
                               alpha=cfg.kd_alpha)
        ce, ce_history = stage("student ce", train_student, cfg, store, vocab, output / "student_ce", alpha=0.0)
        heldout = token_windows(corpus.heldout_prefix, cfg.seq_length, max_samples=cfg.eval_samples)
        metrics = stage("eval", evaluate, {"student from cache (KD)": kd, "student CE only": ce}, teacher, heldout,
                        micro_batch_size=cfg.micro_batch_size)
    panels = {"training cross entropy": {"teacher": [h["loss"] for h in teacher_history],
                                         "student KD (its CE term)": [h["lm loss"] for h in kd_history],
                                         "student CE only": [h["lm loss"] for h in ce_history]},
              "student KD: forward KL to the cached top-K (ghost)": {"student KD": [h["kd loss"] for h in kd_history]}}
    (output / "history.json").write_text(json.dumps(
        {"teacher": teacher_history, "student_kd": kd_history, "student_ce": ce_history}) + "\n")
    plot_curves(panels, output / "loss_curves.png")
    seconds["total"] = sum(seconds.values())
    result = {"metrics": metrics, "seconds": seconds}
    (output / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    (output / "results.md").write_text(results_table(metrics, seconds) + "\n")
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_kd_plugin demo --from-scratch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("outputs/demo_scratch"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default", help="sizes (default: %(default)s)")
    add_corpus_arguments(parser)
    parser.add_argument("--seed", type=int, help="override the preset's seed")
    parser.add_argument("--teacher-steps", type=int, help="override the preset's teacher steps")
    parser.add_argument("--student-steps", type=int, help="override the preset's student steps")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    changes = {name: value for name, value in (("seed", args.seed), ("teacher_steps", args.teacher_steps),
                                               ("student_steps", args.student_steps)) if value is not None}
    preset = PRESETS[args.preset]
    try:
        corpus = dataclasses.replace(preset.corpus, source=args.corpus, text_key=args.text_key)
        cfg = dataclasses.replace(preset, corpus=corpus, **changes)
        result = run_demo(cfg, args.output, overwrite=args.overwrite)
    except STOPPED as error:
        return exit_code(error, args.output)
    print("\n" + results_table(result["metrics"], result["seconds"]))
    print(f"\n[demo] everything is in {args.output}/ (results.md, metrics.json, loss_curves.png)")
    return 0
