"""GPU benchmark of the top-K KD loss head at the published shapes, in the order of what each figure is worth.

    python tools/bench_loss_gpu.py                       # H200: H = 2,880, V = 201,088, T = 8K / 32K / 128K
    TRITON_INTERPRET=1 python tools/bench_loss_gpu.py --cpu-smoke   # CPU, tiny shapes, Triton interpreted

One row per run (loss forward + backward of ``topk_kd_loss``, ghost forward KL, bf16 hidden and weight, K = 100,
one rank's vocabulary without collectives), printed as it finishes, in this order until the time budget says stop:
  1. at each T: ``gemm`` (one bf16 ``[T, H] @ [H, V]``, the rate the loss's GEMMs can reach), then the fused loss on
     its Triton kernels in both modes, ``fused_triton/grad_in_forward`` (3 GEMMs of that size) and
     ``fused_triton/recompute`` (4);
  2. at each T: the same loss on the PyTorch chunk backend (``fused_torch``, fp32 chunks), Forward-chunked, Dense
     (out of memory is a result);
  3. at the middle T: ``chunks_gemm_only`` (the fused loss's chunked bf16 GEMMs alone) and ``chunks_gemm_kernels``
     (plus both kernels on every chunk: the Triton fused loss without its [c, K] token math);
  4. the kernels alone on one [c, V] bf16 chunk, Triton vs PyTorch: ms and GB/s.
Columns: median / min / max ms of ``--reps`` (>= 5) timed calls after one warm-up; TFLOP/s counting 6·T·H·V (the
GEMM row: 2·T·H·V) at the median; ``x gemm``: that rate over the GEMM row's at the same T (grad_in_forward can
approach 1, recompute 0.75); peak memory above the inputs (``torch.cuda.max_memory_allocated``) and its ratio to
the loss head's analytic floor (dX + dW in the inputs' dtype + the teacher ids / log-probs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU (Triton by its interpreter, TRITON_INTERPRET=1): the path, no timings")
    parser.add_argument("--tokens", default="8192,32768,131072", help="T values, comma-separated")
    parser.add_argument("--vocab", type=int, default=201088, help="V (this rank's shard)")
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--k", type=int, default=100, help="teacher top-K")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="the fused loss's chunk budget (default)")
    parser.add_argument("--kernel-chunk-bytes", type=int, default=256 * 2**20,
                        help="size of the bf16 [c, V] chunk in the kernels' rows")
    parser.add_argument("--reps", type=int, default=5, help="timed calls after one warm-up (>= 5)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no run predicted to end after this")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.vocab, args.hidden, args.k = "8,13", 67, 16, 4
        args.chunk_bytes, args.kernel_chunk_bytes = args.chunk_bytes or 4 * 67 * 4, 2048
    if args.reps < 5:
        parser.error(f"--reps={args.reps}: at least 5 (a median with a spread)")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def _inputs(T, args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = (torch.randn(T, 1, args.hidden, generator=gen, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=device) / args.hidden**0.5).to(dtype)
    weight.requires_grad_()
    teacher_ids = torch.randint(0, args.vocab, (T, 1, args.k), generator=gen, device=device, dtype=torch.int32)
    logits = torch.randn(T, 1, args.k, generator=gen, device=device) * 2
    teacher_logprobs = logits.log_softmax(-1) + torch.log(torch.tensor(0.9))  # top-K mass 0.9
    return hidden, weight, teacher_ids, teacher_logprobs


def _loss_step(inputs, impl, kernels, mode, args):
    """One forward + backward; ``kernels`` (the fused loss's chunk backend) is ignored by the references."""
    from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss

    hidden, weight, teacher_ids, teacher_logprobs = inputs
    result = topk_kd_loss(hidden, weight, TopKTeacher(teacher_ids, teacher_logprobs), impl=impl, mode=mode,
                          kernels=kernels, chunk_bytes=args.chunk_bytes, validate=False)
    result.loss_sum.backward()
    hidden.grad = weight.grad = None


def _gemm_step(inputs):
    """The bf16 product the loss's GEMMs are made of, at the whole shape: [T, H] @ [H, V] -> [T, V]."""
    hidden, weight = inputs[0].detach(), inputs[1].detach()
    torch.mm(hidden.view(-1, hidden.shape[-1]), weight.t())


def _chunk_pipeline_step(inputs, args, with_kernels):
    """The fused loss's per-chunk work without its [c, K] token math and collectives (grad_in_forward: X_c Wᵀ, G W,
    Gᵀ X_c in the inputs' dtype, dW accumulated in it too) on [c, V] chunks of ``chunk_bytes``; ``with_kernels``
    adds chunk_row_stats and chunk_logit_grad_ in between, else the logits stand in for their gradient."""
    from megatron_kd_plugin.kernels import chunk_logit_grad_, chunk_row_stats

    hidden, weight, teacher_ids, _ = inputs
    x = hidden.detach().reshape(-1, hidden.shape[-1])  # [T, H]
    w = weight.detach()  # [V, H]
    ids = teacher_ids.reshape(-1, teacher_ids.shape[-1])  # [T, K]
    step = max(1, (args.chunk_bytes or 512 * 2**20) // (w.shape[0] * w.element_size()))
    d_hidden, d_weight = torch.empty_like(x), torch.zeros_like(w)
    for start in range(0, x.shape[0], step):
        rows = slice(start, start + step)
        grad = x[rows] @ w.t()  # [c, V]
        if with_kernels:
            row_max, row_sumexp, gathered = chunk_row_stats(grad, ids[rows], 1.0, exclude=ids[rows])
            lse = row_max + (row_sumexp + (gathered - row_max[:, None]).exp().sum(-1)).log()  # [c]
            sparse = -(gathered - lse[:, None]).softmax(-1)  # [c, K]: a stand-in for the token math's output
            chunk_logit_grad_(grad, lse, torch.ones_like(lse), ids[rows], sparse, 1.0)
        torch.mm(grad, w, out=d_hidden[rows])
        d_weight.addmm_(grad.t(), x[rows])


def _time(step, device, reps):
    """(median, min, max seconds per call; peak bytes above the start) of ``reps`` calls after one warm-up."""
    cuda = device.type == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
    return statistics.median(times), min(times), max(times), peak


HEADER = ("| run | T | V | median ms | min ms | max ms | TFLOP/s | x gemm | peak GiB | x floor |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _row(name, T, args, timed=None, note=None, gemm_tflops=None):
    if note:
        return f"| {name} | {T:,} | {args.vocab:,} | {note} | | | | | | |"
    median, low, high, peak = timed
    flops = (2 if name == "gemm" else 6) * T * args.hidden * args.vocab
    tflops = flops / median / 1e12
    ratio = f"{tflops / gemm_tflops:.3f}" if gemm_tflops and name != "gemm" else "-"
    floor = (T * args.hidden + args.vocab * args.hidden) * 2 + T * args.k * 8  # dX + dW (bf16) + teacher
    return (f"| {name} | {T:,} | {args.vocab:,} | {median * 1e3:.2f} | {low * 1e3:.2f} | {high * 1e3:.2f} | "
            f"{tflops:.1f} | {ratio} | {peak / 2**30:.2f} | {'-' if name == 'gemm' else f'{peak / floor:.2f}'} |")


def _plan(args):
    """(name, T, step factory) in the order of value (module docstring)."""
    runs = []
    for T in args.tokens:
        runs.append(("gemm", T, lambda i: _gemm_step(i)))
        for mode in ("grad_in_forward", "recompute"):
            runs.append((f"fused_triton/{mode}", T, lambda i, m=mode: _loss_step(i, "fused", "triton", m, args)))
    for T in args.tokens:
        runs += [("fused_torch/grad_in_forward", T, lambda i: _loss_step(i, "fused", "torch", "grad_in_forward", args)),
                 ("forward_chunked", T, lambda i: _loss_step(i, "forward_chunked", "torch", "recompute", args)),
                 ("dense", T, lambda i: _loss_step(i, "dense", "torch", "recompute", args))]
    middle = args.tokens[len(args.tokens) // 2]
    runs += [("chunks_gemm_only", middle, lambda i: _chunk_pipeline_step(i, args, False)),
             ("chunks_gemm_kernels", middle, lambda i: _chunk_pipeline_step(i, args, True))]
    return runs


def _loss_rows(args, device, started):
    seconds_per_token = {}   # name -> seconds per call per token of its last run, to predict the next one
    gemm_tflops, failed = {}, set()
    inputs, inputs_t = None, None
    for name, T, step in _plan(args):
        predicted = seconds_per_token.get(name, 0.0) * T * (args.reps + 1)
        if name in failed:
            print(_row(name, T, args, note="skipped: out of memory at a smaller T"), flush=True)
            continue
        if time.perf_counter() - started + predicted > args.budget_s:
            print(_row(name, T, args, note=f"skipped: time budget ({args.budget_s:.0f} s)"), flush=True)
            continue
        if inputs_t != T:
            inputs = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            inputs, inputs_t = _inputs(T, args, device), T
        try:
            timed = _time(lambda: step(inputs), device, args.reps)
            seconds_per_token[name] = timed[0] / T
            if name == "gemm":
                gemm_tflops[T] = 2 * T * args.hidden * args.vocab / timed[0] / 1e12
            print(_row(name, T, args, timed, gemm_tflops=gemm_tflops.get(T)), flush=True)
        except torch.OutOfMemoryError:
            failed.add(name)
            print(_row(name, T, args, note="out of memory"), flush=True)
        finally:
            inputs[0].grad = inputs[1].grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return gemm_tflops


def _kernel_rows(args, device):
    from megatron_kd_plugin.kernels import chunk_logit_grad_, chunk_row_stats

    V = args.vocab
    c = max(1, args.kernel_chunk_bytes // (V * 2))
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = (torch.randn(c, V, generator=gen, device=device) * 3).to(dtype)
    ids = torch.randint(-1, V, (c, args.k + 1), generator=gen, device=device)
    lse, dense = torch.full((c,), 12.0, device=device), torch.randn(c, generator=gen, device=device)
    sparse = torch.randn(c, args.k + 1, generator=gen, device=device)
    nbytes = logits.numel() * logits.element_size()
    print(f"\nKernels alone on one [{c:,}, {V:,}] {str(dtype).removeprefix('torch.')} chunk, median of {args.reps}:")
    print("| kernels | stats ms | stats GB/s | grad ms | grad GB/s |\n|---|---:|---:|---:|---:|")
    for kernels in ("torch", "triton"):
        work = logits.clone()
        stats_s = _time(lambda: chunk_row_stats(work, ids, 0.5, exclude=ids[:, :-1], kernels=kernels), device,
                        args.reps)[0]
        grad_s = _time(lambda: chunk_logit_grad_(work.copy_(logits), lse, dense, ids, sparse, 0.5, kernels=kernels),
                       device, args.reps)[0]
        copy_s = _time(lambda: work.copy_(logits), device, args.reps)[0]  # subtracted from grad_s
        grad_s = max(grad_s - copy_s, 1e-9)
        print(f"| {kernels} | {stats_s * 1e3:.3f} | {nbytes / stats_s / 1e9:.0f} | {grad_s * 1e3:.3f} | "
              f"{2 * nbytes / grad_s / 1e9:.0f} |", flush=True)


def main(argv=None):
    args = _args(argv)
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment (read when triton is imported)")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device: run with --cpu-smoke on CPU")
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: numbers are meaningless)"
    print(f"Loss head, forward + backward: {name}; H={args.hidden:,}, V={args.vocab:,}, K={args.k}, chunk_bytes="
          f"{args.chunk_bytes or 'default'}, {args.reps} reps after a warm-up, torch {torch.__version__}\n")
    print(HEADER, flush=True)
    _loss_rows(args, device, started)
    if time.perf_counter() - started < args.budget_s:
        _kernel_rows(args, device)
    print(f"result: loss head benchmark done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
