"""Distillation quality: does an offline teacher cache keep what online, full-vocabulary KD gives?

    python tools/bench_quality.py [--preset default|small|mini] [--output bench_results/quality] [--reuse outputs/demo_scratch]

First the demo's stages 1-3 (``megatron_kd_plugin.demo.scratch``, the from-scratch demo: stdlib corpus, teacher, top-100 cache at
TP=2), or ``--reuse`` a finished ``demo --from-scratch`` folder's; then, for the sampled variants, sampled stores written by the same
cache tool (``--draws N``, TP=2). Then students of one architecture, step budget, batch order, learning-rate
schedule and seed, each trained by the Megatron-Bridge CPU path (``train_on_cpu``) in its own child process,
differing only in their loss:

    ce            hard labels only (the fused loss at alpha = 0)
    dense         online KD: the teacher runs in the loop, forward KL to its full softmax over the whole
                  vocabulary (the quality ceiling; no cache), alpha * KL + (1 - alpha) * CE
    topK-tail     the fused loss on the cache's K highest teacher log-probs, K in {1, 8, 32, 100}, tail in
                  {ghost, none, renorm}, forward KL, the same alpha
    sampleN       the fused loss's unbiased sampled estimator (tail = sampled) on a store of N ids drawn per token
                  from the teacher (N in {8, 16, 32, 48, 64}), the same alpha
    eqbytesN      top-K ghost with the largest K whose store takes no more bytes per token than sampleN's (the
                  top-100 store truncated to K and re-encoded with the cache's codecs, to measure its size)
    toppP         the fused loss (ghost tail) on a top-p store written by the same cache tool (``--top-p P``, cap K =
                  the preset's top-K, min-k 1, TP=2): per token the fewest top ids whose mass reaches P, P in
                  {0.9, 0.99, 0.999}
    eqtoppP       top-K ghost with the largest K whose store takes no more bytes per token than toppP's (as eqbytesN)
    headHdrawN    the sampled estimator on a head + draws store (``--head H --draws N``, TP=2): per token the exact
                  top-H ids, then N draws from the rest of the distribution (issue #40), (H, N) in {(8, 40), (24, 24),
                  (8, 56)}

alpha is the preset's ``kd_alpha`` (the demo's KD student) unless ``--alpha`` is given; the students' seed (batch
order, initialisation) the preset's unless ``--student-seed`` is given (results then named ``VARIANT-sSEED``).

Each is evaluated densely on held-out text (perplexity, KL(teacher ‖ student), ECE, ``demo.metrics``), with the
bytes per token of the cache it reads, its training wall time and peak memory (the child's peak resident set
during set-up and training, above its resident set before them: the kernel's high-water mark is reset there; big
allocations forced through mmap so freed memory leaves RSS). One table (markdown,
also in ``results.md``) and one PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

TOPK = (1, 8, 32, 100)
TAILS = ("ghost", "none", "renorm")
SAMPLES = (8, 16, 32, 48, 64)
TOP_P = (0.9, 0.99, 0.999)
HEAD_DRAWS = ((8, 40), (24, 24), (8, 56))
VARIANTS = (("ce", "dense") + tuple(f"top{k}-{tail}" for k in TOPK for tail in TAILS)
            + tuple(f"sample{n}" for n in SAMPLES) + tuple(f"eqbytes{n}" for n in SAMPLES)
            + tuple(f"topp{p}" for p in TOP_P) + tuple(f"eqtopp{p}" for p in TOP_P)
            + tuple(f"head{h}draw{n}" for h, n in HEAD_DRAWS))


def _truncate_topk(batch, k: int):
    """The batch (a ``KDRow``) with its teacher top-K cut to the k most probable entries (rank order is not
    assumed)."""
    logprobs, order = batch.teacher.logprobs.topk(k, dim=-1)                       # [b, S, k]
    return batch._replace(teacher=batch.teacher._replace(ids=batch.teacher.ids.gather(-1, order), logprobs=logprobs))


def topk_forward_step(k: int):
    """The plugin's KD forward step on the first k cached entries."""
    from megatron_kd_plugin.bridge.forward_step import kd_forward_step

    def step(state, data_iterator, model):
        return kd_forward_step(state, iter([_truncate_topk(next(data_iterator), k)]), model)

    return step


def dense_forward_step(teacher, alpha: float):
    """Online KD: the teacher's full log-softmax on the fly, forward KL over the whole vocabulary (TP=1), mixed
    with hard-label CE like the fused loss: alpha * KL + (1 - alpha) * CE."""
    import torch
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from megatron_kd_plugin.bridge.forward_step import get_kd_batch
    from megatron_kd_plugin.demo.teacher_training import causal_inputs

    def processor(*, hidden_states, output_layer, output_weight, context, **_):
        weight = output_weight if output_weight is not None else output_layer.weight    # [V, H]
        hidden = copy_to_tensor_model_parallel_region(hidden_states)                    # [s, b, H]
        student = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)              # [s, b, V]
        teacher_lp = context["teacher_logprobs"]                                        # [s, b, V]
        kl = torch.sum(teacher_lp.exp() * (teacher_lp - student), dim=-1)               # [s, b]
        ce = -student.gather(-1, context["labels"][..., None]).squeeze(-1)              # [s, b]
        mask = context["loss_mask"]
        return torch.sum(kl * mask), torch.sum(ce * mask), mask.sum().to(torch.int64)

    def loss_func(output):
        kl_sum, ce_sum, num_tokens = output
        count = num_tokens.float()
        report = {"kd loss": torch.stack([kl_sum.detach(), count]), "lm loss": torch.stack([ce_sum.detach(), count])}
        return alpha * kl_sum + (1 - alpha) * ce_sum, num_tokens.int(), report

    def step(state, data_iterator, model):
        batch, _ = get_kd_batch(data_iterator, is_first_stage=True, is_last_stage=True)
        position_ids, causal = causal_inputs(batch.tokens)
        with torch.no_grad():
            teacher_lp = torch.log_softmax(teacher(batch.tokens, position_ids, causal).float(), -1)  # [b, s, V]
        context = dict(teacher_logprobs=teacher_lp.transpose(0, 1), labels=batch.labels.t(),
                       loss_mask=batch.loss_mask.t())
        output = model(input_ids=batch.tokens, position_ids=position_ids, attention_mask=causal,
                       labels=batch.labels, output_processor=processor, output_processor_context=context)
        return output, loss_func

    return step


def tagged(variant: str, proposal_temperature: float) -> str:
    """The name of a variant's results: sampled variants at a proposal temperature t != 1 carry it."""
    sampled = variant.startswith(("sample", "eqbytes")) and proposal_temperature != 1.0
    return f"{variant}-t{proposal_temperature:g}" if sampled else variant


def result_name(variant: str, proposal_temperature: float, student_seed: int | None) -> str:
    """The name of a variant's result file: :func:`tagged`, and ``-sSEED`` for a ``--student-seed``."""
    return tagged(variant, proposal_temperature) + ("" if student_seed is None else f"-s{student_seed}")


def sampled_store(work: pathlib.Path, n: int, proposal_temperature: float) -> pathlib.Path:
    return work / f"cache_{tagged(f'sample{n}', proposal_temperature)}.zarr"


def head_draws_store(work: pathlib.Path, variant: str) -> tuple[pathlib.Path, int, int]:
    """(the store a ``headHdrawN`` variant reads, H, N)."""
    head, draws = variant.removeprefix("head").split("draw")
    return work / f"cache_{variant}.zarr", int(head), int(draws)


def top_p_store(work: pathlib.Path, variant: str) -> pathlib.Path:
    """The top-p store a ``toppP`` or ``eqtoppP`` variant reads or is sized against."""
    return work / f"cache_{variant.removeprefix('eq')}.zarr"


def store_bytes_per_token(store: pathlib.Path) -> float:
    """Bytes on disk of a store (every file) per cached token."""
    from megatron_kd_plugin.cache import TopKCacheReader

    spec = TopKCacheReader(store).spec
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / (spec.num_samples * spec.seq_length)


def truncated_topk_bytes(store: pathlib.Path, k: int, scratch: pathlib.Path) -> float:
    """Bytes per token a top-``k`` store would take: ``store`` (a top-K store, K >= k) cut to each token's k most
    probable entries, written with the same codecs and shards into ``scratch`` (removed afterwards)."""
    import dataclasses as dc
    import shutil

    import numpy as np

    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.cache.writer import store_shard

    reader = TopKCacheReader(store)
    spec = dc.replace(reader.spec, k=k)
    if scratch.exists():
        shutil.rmtree(scratch)
    fmt.create_store(scratch, spec)
    import zarr

    group = zarr.open_group(scratch, mode="r+")
    for shard in range(spec.num_shards):
        begin, end = spec.shard_range(shard)
        logprobs = reader.group[fmt.LOGPROBS][begin:end]                           # [P, S, K]
        keep = np.sort(np.argsort(-logprobs, axis=-1, kind="stable")[..., :k], axis=-1)
        ids = np.take_along_axis(reader.group[fmt.IDS][begin:end], keep, -1)     # still sorted by id
        store_shard(group, spec, shard, {fmt.TOKENS: reader.group[fmt.TOKENS][begin:end], fmt.IDS: ids,
                                         fmt.LOGPROBS: np.take_along_axis(logprobs, keep, -1)})
    group.attrs.update(complete=True)
    size = store_bytes_per_token(scratch)
    shutil.rmtree(scratch)
    return size


def equal_bytes_k(store: pathlib.Path, budget: float, scratch: pathlib.Path) -> tuple[int, float]:
    """(largest K whose truncated top-K store takes <= ``budget`` bytes/token, its bytes/token); K >= 1."""
    from megatron_kd_plugin.cache import TopKCacheReader

    low, high = 1, TopKCacheReader(store).spec.k
    sizes = {1: truncated_topk_bytes(store, 1, scratch)}
    while low < high:                                        # bytes grow with K: bisect
        mid = (low + high + 1) // 2
        sizes[mid] = truncated_topk_bytes(store, mid, scratch)
        low, high = (mid, high) if sizes[mid] <= budget else (low, mid - 1)
    return low, sizes[low]


def _reset_peak_rss() -> int:
    """Resets this process's peak resident set (Linux ``VmHWM``, via ``/proc/self/clear_refs``); returns the
    current resident set in bytes, the baseline the peak is measured above."""
    import psutil

    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    """Peak resident set in bytes since the last :func:`_reset_peak_rss`."""
    status = pathlib.Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) * 1024


def run_variant(variant: str, work: pathlib.Path, preset: str, student_steps: int | None,
                alpha: float | None, proposal_temperature: float = 1.0, student_seed: int | None = None) -> dict:
    """Trains and evaluates one student (called in a child process); returns its row."""
    import torch

    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.demo.data import DemoCorpus, padded_vocab_size, token_windows
    from megatron_kd_plugin.demo.metrics import evaluate
    from megatron_kd_plugin.demo.scratch import PRESETS, STUDENT_RECIPE, student_overrides
    from megatron_kd_plugin.demo.teacher_training import single_process_megatron
    from megatron_kd_plugin.models.gpt import load_gpt
    from megatron_kd_plugin.commands.train import build_config

    cfg = PRESETS[preset]
    sizes = json.loads((work / "bench" / "bytes.json").read_text())
    if student_steps is not None:
        cfg = dataclasses.replace(cfg, student_steps=student_steps)
    if alpha is not None:
        cfg = dataclasses.replace(cfg, kd_alpha=alpha)
    if student_seed is not None:                      # the teacher and its stores are already written
        cfg = dataclasses.replace(cfg, seed=student_seed)
    corpus = DemoCorpus.load(work / "data")
    vocab = padded_vocab_size(corpus.vocab_size)
    with single_process_megatron(cfg.seed):
        baseline = _reset_peak_rss()
        teacher = None
        store, tail = work / "cache.zarr", None
        if variant == "dense":
            teacher, _ = load_gpt(work / "teacher", tp_size=1)
            teacher.eval()
            step_func = dense_forward_step(teacher, cfg.kd_alpha)
        elif variant == "ce":
            step_func = topk_forward_step(1)  # the KD term is weighted 0; one cached entry keeps the pass cheap
        elif variant.startswith("sample"):
            n = int(variant.removeprefix("sample"))
            store, tail, step_func = sampled_store(work, n, proposal_temperature), "sampled", None
        elif variant.startswith("topp"):
            store, tail, step_func = top_p_store(work, variant), "ghost", None
        elif variant.startswith("head"):
            store, tail, step_func = head_draws_store(work, variant)[0], "sampled", None
        else:
            k, tail = (variant.removeprefix("top").split("-") if variant.startswith("top")
                       else (sizes[tagged(variant, proposal_temperature)]["k"], "ghost"))
            step_func = topk_forward_step(int(k))
        overrides = student_overrides(cfg, store, vocab, work / "bench" / variant,
                                      alpha=0.0 if variant == "ce" else cfg.kd_alpha)
        if tail is not None:
            overrides.append(f"kd.tail={tail}")
        config = build_config(STUDENT_RECIPE, overrides)
        start = time.perf_counter()
        models, history = train_on_cpu(config, *([] if step_func is None else [step_func]))
        seconds = time.perf_counter() - start
        peak = _peak_rss() - baseline
        if teacher is None:
            teacher, _ = load_gpt(work / "teacher", tp_size=1)
        heldout = token_windows(corpus.heldout_prefix, cfg.seq_length, max_samples=cfg.eval_samples)
        metrics = evaluate({variant: models[0]}, teacher, heldout, micro_batch_size=cfg.micro_batch_size,
                           desc=f"eval {variant}")
    name = tagged(variant, proposal_temperature)
    size = sizes.get(name, {"bytes_per_token": 0.0})
    name += f" (top{size['k']}-ghost)" if variant.startswith(("eqbytes", "eqtopp")) else ""
    name += "" if student_seed is None else f" (seed {student_seed})"
    return dict(variant=name, **metrics[variant], teacher=metrics["teacher"], alpha=cfg.kd_alpha,
                bytes_per_token=size["bytes_per_token"],
                student_steps=cfg.student_steps, train_seconds=seconds,
                peak_mib=peak / 2**20, threads=torch.get_num_threads())


def prepare_work(work: pathlib.Path, preset: str, reuse: pathlib.Path | None, overwrite: bool, *,
                 vocab_size: int | None = None, teacher_steps: int | None = None) -> None:
    """Stages 1-3 of the demo into ``work`` (or links a finished demo folder's data, teacher and cache); the
    tokenizer's vocabulary size and the teacher's steps may override the preset's."""
    from megatron_kd_plugin.demo import scratch as pipeline
    from megatron_kd_plugin.demo.data import tokenize_corpus
    from megatron_kd_plugin.demo.teacher_training import single_process_megatron

    if (work / "cache.zarr").exists() and not overwrite:
        built = json.loads((work / "config.json").read_text())
        for name, wanted, have in (("--vocab-size", vocab_size, built["corpus"]["vocab_size"]),
                                   ("--teacher-steps", teacher_steps, built["teacher_steps"])):
            if wanted is not None and wanted != have:
                raise ValueError(f"{name} {wanted}: {work} was built with {have}; pass --overwrite or another --output")
        print(f"[bench] reusing data, teacher and cache in {work}", flush=True)
        return
    pipeline.prepare_output(work, overwrite)
    if reuse is not None:
        for name in ("data", "teacher", "cache.zarr", "config.json"):
            if not (reuse / name).exists():
                raise ValueError(f"--reuse {reuse}: no {name} there (run `python -m megatron_kd_plugin demo --from-scratch` first)")
            (work / name).symlink_to((reuse / name).resolve())
        return
    cfg = pipeline.PRESETS[preset]
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, corpus=dataclasses.replace(cfg.corpus, vocab_size=vocab_size))
    if teacher_steps is not None:
        cfg = dataclasses.replace(cfg, teacher_steps=teacher_steps)
    (work / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    corpus = tokenize_corpus(cfg.corpus).save(work / "data")
    with single_process_megatron(cfg.seed):
        pipeline.train_teacher(cfg, corpus, work / "teacher")
    pipeline.cache_teacher(cfg, corpus, work / "teacher", work / "cache.zarr")


def prepare_sampled_stores(work: pathlib.Path, preset: str, variants: list[str], proposal_temperature: float) -> None:
    """The sampled and top-p stores the chosen variants read (``sampleN``, ``eqbytesN``, ``toppP``), by the cache
    tool at TP=2."""
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.demo import scratch as pipeline
    from megatron_kd_plugin.demo.data import DemoCorpus

    cfg = pipeline.PRESETS[preset]
    corpus = DemoCorpus.load(work / "data")
    for n in sorted({int(v.removeprefix("sample").removeprefix("eqbytes")) for v in variants
                     if v.startswith(("sample", "eqbytes"))}):
        store = sampled_store(work, n, proposal_temperature)
        try:
            TopKCacheReader(store)                     # complete: nothing to do
        except ValueError:                             # absent, or unfinished: the tool (re)writes or resumes it
            pipeline.cache_teacher(cfg, corpus, work / "teacher", store, sample=n,
                                   proposal_temperature=proposal_temperature)
    for variant in (v for v in variants if v.startswith("head")):
        store, head, draws = head_draws_store(work, variant)
        try:
            TopKCacheReader(store)
        except ValueError:
            pipeline.cache_teacher(cfg, corpus, work / "teacher", store, sample=draws, head=head)
    for variant in (v for v in variants if v.startswith(("topp", "eqtopp"))):
        try:
            TopKCacheReader(top_p_store(work, variant))
        except ValueError:
            pipeline.cache_teacher(cfg, corpus, work / "teacher", top_p_store(work, variant),
                                   top_p=float(variant.removeprefix("eq").removeprefix("topp")))


def measure_bytes(work: pathlib.Path, variants: list[str], proposal_temperature: float) -> dict:
    """{tagged variant: {"bytes_per_token", "k"}} of the cache each cached variant reads, into ``bench/bytes.json``."""
    path = work / "bench" / "bytes.json"
    sizes = json.loads(path.read_text()) if path.exists() else {}
    store, scratch = work / "cache.zarr", work / "bench" / "truncated.zarr"
    for variant in variants:
        name = tagged(variant, proposal_temperature)
        if name in sizes or variant in ("ce", "dense"):
            continue
        if variant.startswith("topp"):
            sizes[name] = dict(bytes_per_token=store_bytes_per_token(top_p_store(work, variant)),
                               **kept_statistics(top_p_store(work, variant)))
        elif variant.startswith("top"):
            k = int(variant.removeprefix("top").split("-")[0])
            sizes[name] = dict(k=k, bytes_per_token=truncated_topk_bytes(store, k, scratch))
        elif variant.startswith("head"):
            store, head, draws = head_draws_store(work, variant)
            sizes[name] = dict(k=head + draws, bytes_per_token=store_bytes_per_token(store))
        elif variant.startswith("sample"):
            n = int(variant.removeprefix("sample"))
            sizes[name] = dict(k=n, bytes_per_token=store_bytes_per_token(sampled_store(work, n, proposal_temperature)))
        elif variant.startswith("eqtopp"):
            k, size = equal_bytes_k(store, store_bytes_per_token(top_p_store(work, variant)), scratch)
            sizes[name] = dict(k=k, bytes_per_token=size)
        else:
            n = int(variant.removeprefix("eqbytes"))
            k, size = equal_bytes_k(store, store_bytes_per_token(sampled_store(work, n, proposal_temperature)), scratch)
            sizes[name] = dict(k=k, bytes_per_token=size)
        path.write_text(json.dumps(sizes, indent=1) + "\n")
    return sizes


def kept_statistics(store: pathlib.Path) -> dict[str, float]:
    """A top-p store's cap ``k``, mean ``kept`` ids per token and mean ``mass`` they hold, over every cached token."""
    import numpy as np

    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.store import format as fmt

    reader = TopKCacheReader(store)
    logprobs = reader.group[fmt.LOGPROBS][:].astype(np.float64)                         # [N, S, K]
    return dict(k=reader.spec.k, kept=float(np.isfinite(logprobs).sum(-1).mean()),
                mass=float(np.exp(logprobs).sum(-1).mean()))


def teacher_topk_mass(store: pathlib.Path) -> dict[int, float]:
    """{K: mean over the cached tokens of the teacher's probability mass in its top-K}, K in ``TOPK``."""
    import numpy as np

    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.store import format as fmt

    probs = np.exp(TopKCacheReader(store).group[fmt.LOGPROBS][:].astype(np.float64))      # [N, S, K]
    probs = -np.sort(-probs, axis=-1)
    return {k: float(probs[..., :k].sum(-1).mean()) for k in TOPK if k <= probs.shape[-1]}


def table(rows: list[dict]) -> str:
    """Markdown table; relative columns compare with the online dense-KD row (of the same student seed)."""
    dense = next((r for r in rows if r["variant"].split(" ")[0] == "dense"), None)
    out = ["| student | cache B/token | held-out ppl | KL(teacher ‖ student) | ECE | ppl vs dense | KL vs dense | "
           "train s | peak MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rel = (f"{100 * (r['perplexity'] / dense['perplexity'] - 1):+.2f}% | "
               f"{100 * (r['kl_to_teacher'] / dense['kl_to_teacher'] - 1):+.2f}%" if dense else "- | -")
        size = f"{r['bytes_per_token']:.1f}" if r.get("bytes_per_token") else "-"
        out.append(f"| {r['variant']} | {size} | {r['perplexity']:.3f} | {r['kl_to_teacher']:.4f} | {r['ece']:.4f} | "
                   f"{rel} | "
                   f"{r['train_seconds']:.1f} | {r['peak_mib']:.0f} |")
    teacher = rows[0]["teacher"]
    out.append(f"| (teacher) | | {teacher['perplexity']:.3f} | 0 | {teacher['ece']:.4f} | | | | |")
    return "\n".join(out)


def _color(variant: str) -> str:
    """A variant's bar colour: one per kind of store, top-K by its tail."""
    kinds = (("ce", "tab:gray"), ("dense", "tab:green"), ("topp", "tab:olive"), ("sample", "tab:purple"),
             ("head", "tab:brown"), ("eq", "tab:cyan"))
    return next((color for prefix, color in kinds if variant.startswith(prefix)), None) or \
        {"ghost": "tab:blue", "none": "tab:orange", "renorm": "tab:red"}[variant.split("-")[1]]


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "kl_to_teacher", "held-out KL(teacher ‖ student), nats/token"),
                           (axes[1], "perplexity", "held-out perplexity")):
        values = [r[key] for r in rows]
        colors = [_color(n.split(" ")[0]) for n in names]
        ax.bar(range(len(rows)), values, color=colors)
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.set_ylim(min(values) * 0.95, max(values) * 1.02)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("students: CE only, online dense KD, cached top-K x tail, sampled / head + draws caches, top-K at "
                 "their bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from megatron_kd_plugin.demo.scratch import PRESETS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--output", type=pathlib.Path, default=REPO_ROOT / "bench_results" / "quality")
    parser.add_argument("--reuse", type=pathlib.Path, help="a finished demo folder of the same preset")
    parser.add_argument("--overwrite", action="store_true", help="redo stages 1-3 and every variant")
    parser.add_argument("--student-steps", type=int, help="override the preset's student steps (<= its cache)")
    parser.add_argument("--vocab-size", type=int, help="override the preset's tokenizer vocabulary (a new --output)")
    parser.add_argument("--teacher-steps", type=int, help="override the preset's teacher steps (a new --output)")
    parser.add_argument("--alpha", type=float, help="override the preset's kd_alpha for every KD student (dense too)")
    parser.add_argument("--proposal-temperature", type=float, default=1.0,
                        help="proposal temperature t of the sampled stores (results of t != 1 are named -tT)")
    parser.add_argument("--student-seed", type=int, help="the students' seed (default: the preset's)")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = args.output
    if args.child:
        row = run_variant(args.child, work, args.preset, args.student_steps, args.alpha, args.proposal_temperature,
                          args.student_seed)
        (work / "bench" / f"{result_name(args.child, args.proposal_temperature, args.student_seed)}.json").write_text(
            json.dumps(row, indent=1) + "\n")
        return 0
    prepare_work(work, args.preset, args.reuse, args.overwrite, vocab_size=args.vocab_size,
                 teacher_steps=args.teacher_steps)
    (work / "bench").mkdir(exist_ok=True)
    prepare_sampled_stores(work, args.preset, args.variants, args.proposal_temperature)
    measure_bytes(work, args.variants, args.proposal_temperature)
    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for variant in args.variants:
        result = work / "bench" / f"{result_name(variant, args.proposal_temperature, args.student_seed)}.json"
        if args.overwrite or not result.exists():
            print(f"[bench] {variant}", flush=True)
            extra = [] if args.student_steps is None else ["--student-steps", str(args.student_steps)]
            extra += [] if args.alpha is None else ["--alpha", str(args.alpha)]
            extra += ["--proposal-temperature", str(args.proposal_temperature)]
            extra += [] if args.student_seed is None else ["--student-seed", str(args.student_seed)]
            subprocess.run([sys.executable, __file__, "--preset", args.preset, "--output", str(work),
                            "--child", variant, *extra], check=True, env=env, cwd=REPO_ROOT)
        rows.append(json.loads(result.read_text()))
    mass = teacher_topk_mass(work / "cache.zarr")
    text = table(rows) + "\n\nTeacher probability mass in its top-K, mean over the cached tokens: " + ", ".join(
        f"K={k}: {m:.3f}" for k, m in mass.items())
    sizes = json.loads((work / "bench" / "bytes.json").read_text())
    text += "".join(f"\n\n{v}: {sizes[v]['kept']:.2f} ids kept per token (mean, cap {sizes[v]['k']}), mass kept "
                    f"{sizes[v]['mass']:.4f}" for v in args.variants if v.startswith("topp"))
    (work / "results.md").write_text(text + "\n")
    plot(rows, work / "quality.png")
    print("\n" + text + f"\n\n[bench] {work / 'results.md'}, {work / 'quality.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
