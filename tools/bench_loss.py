"""Benchmark the top-K KD loss formulations side by side: peak memory and time of forward + backward.

    python tools/bench_loss.py                                   # T=16384 H=512 V=32768 K=100 fp32, sweep T
    python tools/bench_loss.py --tokens 4096 --sweep 1024,2048 --variants fused_recompute,dense

Each variant runs in its own child process with big allocations forced through mmap
(MALLOC_MMAP_THRESHOLD_=65536), so freed memory leaves the resident set; the child resets its peak RSS
(/proc/self/clear_refs) once the inputs exist and reports the peak above them (gradients dX, dW included).
Variants: dense, forward_chunked and fused (both modes) from megatron_kd_plugin.loss (ghost forward KL), the
megatron-core peer ``megatron.training.distillation.cached_logits_loss.topk_kl_div`` (ghost, fed full logits
from an autograd X W^T), the renorm K-rows fast path, and the matmul-only floors: the chunked X W^T, G W, G^T X
products alone (``floor_3mm``, the floor of grad_in_forward) plus the recompute product (``floor_4mm``), and
``teacher_side``: the loss's per-token preparation alone (the teacher buckets in float64, shard-local ids), whose
time is part of every fused variant's. Before its baseline each child runs its variant once on 64 tokens (imports,
thread pools). The memory floor of the fused variants (``floor GiB``) is what they cannot avoid holding at once:
one fp32 logits chunk + dX + dW (returned here: there is no DDP main_grad) + 12 B per teacher slot (int32 local id,
fp32 bucket log-prob, flags; recompute keeps its fp32 support coefficients instead of dX, dW during forward).
Ends with the analytic memory model at gpt-oss shapes.

``--ensemble`` measures instead, in this one process and in alternating rounds (best of each), the fused loss
(recompute, forward + backward) on an ensemble of two teachers of K ids each (``cache.rows.ensemble_rows``: the two rows
side by side, 2K slots, the ids they share merged by the loss) against one teacher of 2K distinct ids (the doubled K)
and one of K, in CPU seconds of this process (and wall): an ensemble must cost no more than the doubled K it carries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("dense", "megatron_peer", "forward_chunked", "fused_recompute", "fused_grad_in_forward",
            "renorm_rows", "floor_3mm", "floor_4mm", "teacher_side")
FLOOR_OF = {"fused_grad_in_forward": "floor_3mm", "fused_recompute": "floor_4mm", "forward_chunked": "floor_3mm",
            "megatron_peer": "floor_3mm", "dense": "floor_3mm"}
GPT_OSS = dict(tokens=131_072, hidden=2880, vocab=201_088, k=100)
WARMUP_TOKENS = 64


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _inputs(args, tokens):
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = (torch.randn(tokens, 1, args.hidden, generator=gen) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5).to(dtype).requires_grad_()
    teacher_ids = torch.randint(0, args.vocab, (tokens, 1, args.k), generator=gen, dtype=torch.int32)
    teacher_logprobs = (torch.randn(tokens, 1, args.k, generator=gen) * 2).log_softmax(-1) + torch.log(
        torch.tensor(0.9))                                                   # top-K mass 0.9
    loss_mask = torch.ones(tokens, 1)
    return hidden, weight, teacher_ids, teacher_logprobs, loss_mask


def _floor(hidden, weight, chunk, recompute):
    """The matmuls of the fused loss alone, chunk by chunk (forward product first when ``recompute``)."""
    import torch

    x = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    d_hidden, d_weight = torch.zeros_like(x), torch.zeros_like(w)
    if recompute:
        for start in range(0, x.shape[0], chunk):
            _ = x[start:start + chunk] @ w.t()                                # [c, V]
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        grad = x[rows] @ w.t()                                               # [c, V] stands in for G
        torch.mm(grad, w, out=d_hidden[rows])
        d_weight.addmm_(grad.t(), x[rows])


def _run_variant(variant, args, hidden, weight, teacher_ids, teacher_logprobs, loss_mask):
    import torch

    from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss
    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES

    chunk_bytes = args.chunk_bytes or DEFAULT_CHUNK_BYTES["cpu"]
    if variant == "teacher_side":
        from megatron_kd_plugin.loss.loss_plan import LossPlan, prepare_batch
        from megatron_kd_plugin.loss.options import KDLossOptions
        from megatron_kd_plugin.loss.tp import resolve_shard

        plan = LossPlan(options=KDLossOptions(chunk_bytes=args.chunk_bytes), shard=resolve_shard(None, args.vocab),
                        dtype=torch.float32, with_labels=False)
        prepare_batch(plan, TopKTeacher(teacher_ids, teacher_logprobs), loss_mask, None)
        return
    if variant.startswith("floor"):
        _floor(hidden, weight, max(1, chunk_bytes // (args.vocab * 4)), recompute=variant == "floor_4mm")
        return
    if variant == "megatron_peer":
        from megatron.training.distillation.cached_logits_loss import topk_kl_div

        logits = hidden @ weight.t()                                          # [s, b, V]
        per_token = topk_kl_div(logits, teacher_logprobs, teacher_ids.long(), 1, 0, None, add_ghost_token=True)
        (per_token * loss_mask.t()).sum().backward()                          # [b, s]
        return
    options = dict(impl="fused", chunk_bytes=args.chunk_bytes)
    if variant in ("dense", "forward_chunked"):
        options["impl"] = variant
    elif variant == "renorm_rows":
        options["tail"] = "renorm"
    else:
        options["mode"] = variant.removeprefix("fused_")
    result = topk_kd_loss(hidden, weight, TopKTeacher(teacher_ids, teacher_logprobs), loss_mask=loss_mask, **options)
    result.loss_sum.backward()


def child(args) -> None:
    """Run one variant at one T and print a JSON line: peak bytes above the inputs and seconds."""
    import gc

    import psutil
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    _run_variant(args.child, args, *_inputs(args, WARMUP_TOKENS))        # imports, thread pools: not the loss's
    inputs = _inputs(args, args.tokens)
    gc.collect()
    base = psutil.Process().memory_info().rss
    _reset_peak_rss()
    start = time.perf_counter()
    _run_variant(args.child, args, *inputs)
    seconds = time.perf_counter() - start
    print(json.dumps(dict(variant=args.child, tokens=args.tokens, peak=_peak_rss_bytes() - base, seconds=seconds)))


def _spawn(variant, tokens, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(tokens), "--hidden", str(args.hidden),
           "--vocab", str(args.vocab), "--k", str(args.k), "--dtype", args.dtype]
    if args.chunk_bytes:
        cmd += ["--chunk-bytes", str(args.chunk_bytes)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return dict(variant=variant, tokens=tokens, peak=float("nan"), seconds=float("nan"),
                    error=done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _memory_floor(variant: str, args, tokens: int) -> int | None:
    """Bytes a fused variant must hold at its peak (module docstring); None for the others."""
    if not variant.startswith("fused_"):
        return None
    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES

    chunk_rows = max(1, (args.chunk_bytes or DEFAULT_CHUNK_BYTES["cpu"]) // (args.vocab * 4))
    return 4 * (chunk_rows * args.vocab + tokens * args.hidden + args.vocab * args.hidden) + 12 * tokens * args.k


def _gib(n: float) -> str:
    return f"{n / 2**30:8.3f}"


def _memory_model(args) -> None:
    """Analytic peak memory above the inputs (fp32 grads and buffers) at gpt-oss shapes."""
    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES

    t, h, v, k = GPT_OSS["tokens"], GPT_OSS["hidden"], GPT_OSS["vocab"], GPT_OSS["k"]
    chunk = args.chunk_bytes or DEFAULT_CHUNK_BYTES["cuda"]
    print(f"\nAnalytic memory model at gpt-oss shapes T={t:,} H={h} V={v:,} K={k} (fp32 gradients, CUDA chunk "
          f"budget {chunk / 2**20:.0f} MiB, GiB):")
    print(f"{'variant':<24}{'formula':<58}{'tp=1':>9}{'tp=8':>9}")
    rows = [
        ("dense (reference)", "~6 T V 4B (logits, log q, teacher grid, grads)", lambda vp: 6 * t * v * 4),
        ("megatron_peer", "~3 T V/tp 4B (logits, exp, grad) + dX + dW", lambda vp: 3 * t * vp * 4 + (t + vp) * h * 4),
        ("forward_chunked", "2 T V/tp 4B (logits + grad) + dX + dW", lambda vp: 2 * t * vp * 4 + (t + vp) * h * 4),
        ("fused (either mode)", "chunk_bytes + dX + dW + ~12 T K B (per-token)",
         lambda vp: chunk + (t + vp) * h * 4 + 12 * t * k),
        ("fused into main_grad", "recompute: chunk_bytes + dX + ~12 T K B (no dW)",
         lambda vp: chunk + t * h * 4 + 12 * t * k),
        ("renorm_rows", "dX + dW + ~8 T K 4B (sparse rows)",
         lambda vp: (t + vp) * h * 4 + 8 * t * k * 4),
    ]
    for name, formula, fn in rows:
        print(f"{name:<24}{formula:<58}{_gib(fn(v))}{_gib(fn(v // 8))}")


def ensemble_cost(args) -> None:
    """Prints the fused loss's time on an ensemble of two K-teachers against one teacher of 2K and one of K (module
    docstring); the second teacher shares about half its ids with the first (two teachers of one tokenizer agree on
    the likely tokens)."""
    import torch

    from megatron_kd_plugin.cache.rows.ensemble_rows import mixture_teacher
    from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, weight, _, _, loss_mask = _inputs(args, args.tokens)
    gen = torch.Generator().manual_seed(1)
    t, k = args.tokens, args.k
    doubled = torch.stack([torch.randperm(args.vocab, generator=gen)[:2 * k] for _ in range(t)])[:, None]  # [T, 1, 2K]
    mass = torch.log(torch.tensor(0.9))                                       # each teacher's top-K mass 0.9
    first_lp, second_lp = ((torch.randn(t, 1, k, generator=gen) * 2).log_softmax(-1) + mass for _ in range(2))
    first = TopKTeacher(doubled[..., :k].to(torch.int32), first_lp)
    shared = torch.cat([doubled[..., :k // 2], doubled[..., k:k + k - k // 2]], -1)   # half of its ids are first's
    second = TopKTeacher(shared.to(torch.int32), second_lp)
    both = TopKTeacher(doubled.to(torch.int32), torch.cat([first_lp, second_lp], -1) - torch.log(torch.tensor(2.0)))
    teachers = {"one teacher, K": first, "one teacher, 2K distinct ids": both,
                "ensemble of two K-teachers (2K slots)": mixture_teacher([first, second], (0.5, 0.5))}
    best = {name: [float("inf")] * 2 for name in teachers}                      # [CPU seconds, wall seconds]
    for _ in range(args.rounds):
        for name, teacher in teachers.items():
            h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
            cpu, wall = time.process_time(), time.perf_counter()
            topk_kd_loss(h, w, teacher, loss_mask=loss_mask, chunk_bytes=args.chunk_bytes).loss_sum.backward()
            spent = (time.process_time() - cpu, time.perf_counter() - wall)
            best[name] = [min(a, b) for a, b in zip(best[name], spent)]
    print(f"Fused top-K loss (recompute, ghost), forward + backward: T={t} H={args.hidden} V={args.vocab} K={k} "
          f"{args.dtype}, torch threads {torch.get_num_threads()}, best of {args.rounds} alternating rounds, load "
          f"average {os.getloadavg()[0]:.1f}\n")
    print("| teacher | slots per token | CPU s | wall s | vs 2K distinct (CPU s) |")
    print("|---|---:|---:|---:|---:|")
    reference = best["one teacher, 2K distinct ids"][0]
    for name, teacher in teachers.items():
        cpu, wall = best[name]
        print(f"| {name} | {teacher.ids.shape[-1]} | {cpu:.3f} | {wall:.3f} | {cpu / reference:.3f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="T = s * b tokens of the main table")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--chunk-bytes", type=int, default=None, help="fused chunk budget (default: the loss's)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--sweep", default="4096,8192", help="extra T values for the memory-vs-T table ('' = none)")
    parser.add_argument("--sweep-variants", default="megatron_peer,forward_chunked,fused_recompute,"
                                                    "fused_grad_in_forward")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads in each child (default: torch's; 1 is steadier on a busy box)")
    parser.add_argument("--ensemble", action="store_true", help="an ensemble of two K-teachers against one teacher "
                        "of 2K ids (module docstring)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of --ensemble")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    if args.ensemble:
        ensemble_cost(args)
        return
    from tqdm import tqdm

    variants = [v for v in args.variants.split(",") if v]
    sweep_tokens = [int(t) for t in args.sweep.split(",") if t]
    sweep_variants = [v for v in args.sweep_variants.split(",") if v]
    jobs = [(v, args.tokens) for v in variants] + [(v, t) for t in sweep_tokens for v in sweep_variants]
    results = {}
    for variant, tokens in tqdm(jobs, desc="variants", file=sys.stderr):
        results[variant, tokens] = _spawn(variant, tokens, args)

    print(f"Top-K KD loss, forward + backward: T={args.tokens} H={args.hidden} V={args.vocab} K={args.k} "
          f"{args.dtype}, {os.cpu_count()} cores, torch threads {args.threads or 'default'}, load average "
          f"{os.getloadavg()[0]:.1f}")
    dense = results.get(("dense", args.tokens))
    print(f"{'variant':<24}{'peak GiB':>9}{'floor GiB':>10}{'peak/floor':>11}{'time s':>9}{'peak/dense':>12}"
          f"{'time/dense':>12}{'time/floor':>12}")
    for variant in variants:
        r = results[variant, args.tokens]
        floor = results.get((FLOOR_OF.get(variant, ""), args.tokens))
        memory_floor = _memory_floor(variant, args, args.tokens)
        ratio = lambda a, b: f"{a / b:12.3f}" if b and b == b and b > 0 else f"{'-':>12}"  # noqa: E731
        print(f"{variant:<24}{_gib(r['peak'])}" + (f"{_gib(memory_floor)}  {ratio(r['peak'], memory_floor)[2:]}"
                                                    if memory_floor else f"{'-':>10}{'-':>11}")
              + f" {r['seconds']:8.2f}"
              f"{ratio(r['peak'], dense['peak'] if dense else None)}"
              f"{ratio(r['seconds'], dense['seconds'] if dense else None)}"
              f"{ratio(r['seconds'], floor['seconds'] if floor and variant in FLOOR_OF else None)}"
              + (f"   ERROR {r['error']}" if "error" in r else ""))
    if sweep_tokens:
        all_tokens = sorted(set(sweep_tokens + [args.tokens]))
        print("\nPeak GiB above the inputs (time s) versus T:")
        print(f"{'variant':<24}" + "".join(f"{t:>18}" for t in all_tokens))
        for variant in sweep_variants:
            cells = [results.get((variant, t)) for t in all_tokens]
            print(f"{variant:<24}" + "".join(f"{'-':>18}" if c is None else
                                             f"{_gib(c['peak'])} ({c['seconds']:6.2f})".rjust(18) for c in cells))
    _memory_model(args)


if __name__ == "__main__":
    main()
