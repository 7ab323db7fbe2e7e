"""GPU benchmark of the top-K KD loss head at gpt-oss-like shapes, side by side in one run, plus the kernels alone.

    python tools/bench_loss_gpu.py --out bench_results/loss_gpu.md          # H200: H=2880, V in {201088, V/8}
    python tools/bench_loss_gpu.py --cpu-smoke                              # CPU, tiny shapes, Triton interpreted

Table 1 (loss forward + backward of ``topk_kd_loss``, ghost forward KL, bf16 hidden/weight, one rank's vocab shard
without collectives): Dense vs Forward-chunked vs Fused PyTorch (kernels="torch") vs Fused Triton
(kernels="triton"); then two bounds for the fused loss: ``chunks_gemm_only`` (the chunked bf16 GEMMs alone:
X_c Wᵀ, G W, Gᵀ X_c, + the recompute product in mode "recompute") and ``chunks_gemm_kernels`` (the same plus the
two kernels on every chunk: the Triton fused loss minus its [c, K] token math and collectives). Columns: ms,
TFLOP/s counting 6·T·H·V, peak memory above the inputs (torch.cuda.max_memory_allocated) and its ratio to the
analytic floor of the loss head (dX + dW in the inputs' dtype + the per-token teacher state). Out-of-memory runs
and runs the time budget cannot afford are reported as such. Table 2: ``chunk_row_stats`` and ``chunk_logit_grad_``
on one [c, Vp] bf16 chunk, Triton vs PyTorch, ms and GB/s (the stats read the chunk once; the gradient reads and
writes it once).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

VARIANTS = (("dense", "dense", "torch"), ("forward_chunked", "forward_chunked", "torch"),
            ("fused_torch", "fused", "torch"), ("fused_triton", "fused", "triton"))


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU (Triton by its interpreter): checks the script runs, no timings")
    parser.add_argument("--tokens", default="8192,32768,131072", help="T values, comma-separated")
    parser.add_argument("--vocab", default="201088,25136", help="V (this rank's shard) values, comma-separated")
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--k", type=int, default=100, help="teacher top-K")
    parser.add_argument("--mode", default="recompute", choices=("recompute", "grad_in_forward"))
    parser.add_argument("--chunk-bytes", type=int, default=None, help="the fused loss's chunk budget (default)")
    parser.add_argument("--kernel-chunk-bytes", type=int, default=256 * 2**20,
                        help="size of the bf16 [c, V] chunk in the kernels' table")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions after one warm-up")
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip runs predicted to overrun this")
    parser.add_argument("--out", default="bench_results/loss_gpu.md", help="markdown table written here")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.vocab, args.hidden, args.k, args.reps = "16,40", "131,63", 32, 4, 1
        args.chunk_bytes, args.kernel_chunk_bytes = args.chunk_bytes or 16 * 131 * 4, 2048
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.vocab = [int(v) for v in args.vocab.split(",")]
    return args


class _Clock:
    """Wall time of a GPU (events) or CPU region, and peak memory above the memory allocated at the start."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = float("nan")
        self.seconds = time.perf_counter() - self.start


def _inputs(T, V, args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = (torch.randn(T, 1, args.hidden, generator=gen, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, args.hidden, generator=gen, device=device) / args.hidden**0.5).to(dtype)
    weight.requires_grad_()
    teacher_ids = torch.randint(0, V, (T, 1, args.k), generator=gen, device=device, dtype=torch.int32)
    logits = torch.randn(T, 1, args.k, generator=gen, device=device) * 2
    teacher_logprobs = logits.log_softmax(-1) + torch.log(torch.tensor(0.9))  # top-K mass 0.9
    return hidden, weight, teacher_ids, teacher_logprobs


def _loss_step(inputs, impl, kernels, args):
    """One forward + backward; ``kernels`` (the fused loss's chunk backend) is ignored by the references."""
    from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss

    hidden, weight, teacher_ids, teacher_logprobs = inputs
    result = topk_kd_loss(hidden, weight, TopKTeacher(teacher_ids, teacher_logprobs), impl=impl, mode=args.mode,
                          kernels=kernels, chunk_bytes=args.chunk_bytes, validate=False)
    result.loss_sum.backward()
    hidden.grad = weight.grad = None


def _chunk_pipeline_step(inputs, args, with_kernels):
    """The fused loss's per-chunk work without its [c, K] token math and collectives: X_c Wᵀ (+ once more in mode
    "recompute"), G W and Gᵀ X_c in the inputs' dtype (dW accumulated in it too), on [c, V] chunks of
    ``chunk_bytes``; ``with_kernels`` adds chunk_row_stats and chunk_logit_grad_ (Triton on CUDA) in between, else
    the logits stand in for their gradient (the GEMM floor)."""
    from megatron_kd_plugin.kernels import chunk_logit_grad_, chunk_row_stats

    hidden, weight, teacher_ids, _ = inputs
    x = hidden.detach().reshape(-1, hidden.shape[-1])  # [T, H]
    w = weight.detach()  # [V, H]
    ids = teacher_ids.reshape(-1, teacher_ids.shape[-1])  # [T, K]
    step = max(1, (args.chunk_bytes or 128 * 2**20) // (w.shape[0] * w.element_size()))
    d_hidden, d_weight = torch.empty_like(x), torch.zeros_like(w)
    for start in range(0, x.shape[0], step):
        rows = slice(start, start + step)
        grad = x[rows] @ w.t()  # [c, V]
        if with_kernels:
            row_max, row_sumexp, gathered = chunk_row_stats(grad, ids[rows], 1.0, exclude=ids[rows])
            lse = row_max + (row_sumexp + (gathered - row_max[:, None]).exp().sum(-1)).log()  # [c]
            dense = torch.ones_like(lse)
            sparse = -(gathered - lse[:, None]).softmax(-1)  # [c, K]: a stand-in for the token math's output
        if args.mode == "recompute":
            grad = x[rows] @ w.t()
        if with_kernels:
            chunk_logit_grad_(grad, lse, dense, ids[rows], sparse, 1.0)
        torch.mm(grad, w, out=d_hidden[rows])
        d_weight.addmm_(grad.t(), x[rows])


def _predicted(last, T, reps):
    """Seconds the next run (warm-up + reps) should take, scaled linearly in T from the last one (0 if none)."""
    return 0.0 if last is None else last[1] * T / last[0] * (reps + 1)


def _time(step, device, reps):
    """(seconds per call, peak bytes above the start) after one warm-up call."""
    step()
    with _Clock(device) as clock:
        for _ in range(reps):
            step()
    return clock.seconds / reps, clock.peak


def _loss_table(args, device, started):
    rows = []
    last = {}  # (variant, V) -> (T, seconds per call) of the last run, to predict the next one
    for V in args.vocab:
        for T in args.tokens:
            flops = 6 * T * args.hidden * V
            inputs = _inputs(T, V, args, device)
            elem = inputs[0].element_size()
            floor = (T * args.hidden + V * args.hidden) * elem + T * args.k * 8  # dX + dW + teacher ids/log-probs
            runs = [(name, lambda i=impl, k=kernels: _loss_step(inputs, i, k, args))
                    for name, impl, kernels in VARIANTS]
            runs += [("chunks_gemm_only", lambda: _chunk_pipeline_step(inputs, args, False)),
                     ("chunks_gemm_kernels", lambda: _chunk_pipeline_step(inputs, args, True))]
            for name, step in runs:
                row = {"variant": name, "T": T, "V": V}
                if time.perf_counter() - started + _predicted(last.get((name, V)), T, args.reps) > args.budget_s:
                    row["note"] = "skipped: time budget"
                else:
                    try:
                        seconds, peak = _time(step, device, args.reps)
                        last[(name, V)] = (T, seconds)
                        row.update(ms=1e3 * seconds, tflops=flops / seconds / 1e12, peak_gib=peak / 2**30,
                                   vs_floor=peak / floor)
                    except torch.OutOfMemoryError:
                        row["note"] = "out of memory"
                    finally:
                        inputs[0].grad = inputs[1].grad = None
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                rows.append(row)
                print(_format_row(row), flush=True)
            del inputs
    return rows


def _kernel_table(args, device):
    from megatron_kd_plugin.kernels import chunk_logit_grad_, chunk_row_stats

    rows = []
    for V in args.vocab:
        c = max(1, args.kernel_chunk_bytes // (V * 2))
        gen = torch.Generator(device=device).manual_seed(1)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        logits = (torch.randn(c, V, generator=gen, device=device) * 3).to(dtype)
        ids = torch.randint(-1, V, (c, args.k + 1), generator=gen, device=device)
        lse, dense = torch.full((c,), 12.0, device=device), torch.randn(c, generator=gen, device=device)
        sparse = torch.randn(c, args.k + 1, generator=gen, device=device)
        nbytes = logits.numel() * logits.element_size()
        for kernels in ("torch", "triton"):
            work = logits.clone()
            stats_s, _ = _time(lambda: chunk_row_stats(work, ids, 0.5, exclude=ids[:, :-1], kernels=kernels),
                               device, args.reps)
            grad_s, _ = _time(lambda: chunk_logit_grad_(work.copy_(logits), lse, dense, ids, sparse, 0.5,
                                                        kernels=kernels), device, args.reps)
            copy_s, _ = _time(lambda: work.copy_(logits), device, args.reps)  # subtracted from grad_s
            grad_s = max(grad_s - copy_s, 1e-9)
            row = {"kernels": kernels, "c": c, "V": V, "stats_ms": 1e3 * stats_s, "stats_gbs": nbytes / stats_s / 1e9,
                   "grad_ms": 1e3 * grad_s, "grad_gbs": 2 * nbytes / grad_s / 1e9}
            rows.append(row)
            print(row, flush=True)
    return rows


def _format_row(row):
    if "note" in row:
        return f"| {row['variant']} | {row['T']} | {row['V']} | {row['note']} | | | |"
    return (f"| {row['variant']} | {row['T']} | {row['V']} | {row['ms']:.1f} | {row['tflops']:.1f} | "
            f"{row['peak_gib']:.2f} | {row['vs_floor']:.2f} |")


def _markdown(args, device, loss_rows, kernel_rows):
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: numbers are meaningless)"
    lines = [f"# Loss head benchmark: {name}", "",
             f"H={args.hidden}, K={args.k}, mode={args.mode}, chunk_bytes={args.chunk_bytes}, reps={args.reps}, "
             f"torch {torch.__version__}", "",
             "| variant | T | V | ms (fwd+bwd) | TFLOP/s (6·T·H·V) | peak above inputs GiB | x analytic floor |",
             "|---|---|---|---|---|---|---|"]
    lines += [_format_row(row) for row in loss_rows]
    lines += ["", "| kernels | c | V | stats ms | stats GB/s | grad ms | grad GB/s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernels']} | {r['c']} | {r['V']} | {r['stats_ms']:.3f} | {r['stats_gbs']:.0f} | "
              f"{r['grad_ms']:.3f} | {r['grad_gbs']:.0f} |" for r in kernel_rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = _args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read at the kernels' first launch
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device: run with --cpu-smoke on CPU")
    started = time.perf_counter()
    kernel_rows = _kernel_table(args, device)
    loss_rows = _loss_table(args, device, started)
    table = _markdown(args, device, loss_rows, kernel_rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as out:
        out.write(table)
    print(table)
    print(f"written to {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
