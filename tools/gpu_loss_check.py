"""Correctness of the fused loss on its Triton kernels at a real vocabulary (tools/gpu_check.sh's first stage).

    python tools/gpu_loss_check.py            # CUDA: V = 201,088, H = 2,880, T = 1,531 tokens, K = 100
    TRITON_INTERPRET=1 python tools/gpu_loss_check.py --device cpu --vocab 389 --hidden 16 --tokens 37 --k 8 \\
        --chunk-tokens 0,2                    # the CPU rehearsal: the same path, the kernels interpreted

The tests (tests/loss_triton_checks.py) hold the kernels to float64 at V <= 257, where every launch is one tile of
one split. Here V is gpt-oss's: for each input dtype (bf16 first, then fp32) and each chunk size (``--chunk-tokens``:
0 = the loss's default budget, c ~ 1,300 tokens of bf16 logits on CUDA, so each row is one split streamed in ~25-98
tiles; 16 = 25 splits of ~8K columns a row, merged by the split-merge step; T not a multiple of c, so the last chunk
is partial), ghost tail, forward KL, 10 % of tokens masked; then, in bf16, a head + draws teacher (``--head-draws``:
the exact top-8 of a full teacher and 40 draws from the rest, ``cache --head 8 --draws 40``) with the sampled tail:

  triton_recompute, triton_grad_in_forward   topk_kd_loss(impl="fused", kernels="triton", mode=...)
  torch_recompute, torch_grad_in_forward     topk_kd_loss(impl="fused", kernels="torch", mode=...), at the
                                             default chunk only: splits are the Triton kernels' notion, and the
                                             PyTorch backend (fp32 GEMMs, W cast per chunk) took 31 s at c = 16 on
                                             the H200 (2026-12-04), over the stage's budget

each against float64: ``impl="dense"`` on float64 copies of the same rounded inputs (loss sum, dX, dW). The error of
a tensor is max |got - ref| / max |ref|; bounds ``BOUNDS`` (fp32 1e-4; bf16 2e-2, the bf16 logits chunk and
gradient of the Triton path are rounded once each). One markdown row per (dtype, chunk, variant) as it finishes, then
``result: ...``; exit status 1 if any error is over its bound.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megatron_kd_plugin.loss import SampledTeacher, TopKTeacher

BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
VARIANTS = (("triton", "grad_in_forward"), ("triton", "recompute"), ("torch", "grad_in_forward"),
            ("torch", "recompute"))


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--tokens", type=int, default=1531, help="T (odd: the last chunk is partial)")
    parser.add_argument("--k", type=int, default=100, help="teacher ids per token")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--chunk-tokens", default="0,16", help="tokens per Triton chunk; 0 = the loss's default")
    parser.add_argument("--head-draws", default="8,40", help="HEAD,DRAWS of the head + draws teacher (bf16 only); "
                        "'' skips it")
    return parser.parse_args(argv)


def _inputs(args, dtype, device):
    """hidden [T, 1, H] and weight [V, H] rounded to ``dtype``; a teacher top-K of distinct ids holding 0.9 of the
    mass [T, 1, K]; a loss mask [T, 1] with 10 % zeros."""
    gen = torch.Generator().manual_seed(0)
    t, h, v, k = args.tokens, args.hidden, args.vocab, args.k
    hidden = (torch.randn(t, 1, h, generator=gen) * 0.7).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * 2 / h**0.5).to(dtype)
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(t)]).view(t, 1, k).to(torch.int32)
    logprobs = (torch.randn(t, 1, k, generator=gen, dtype=torch.float64) * 2).log_softmax(-1) + torch.log(
        torch.tensor(0.9, dtype=torch.float64))
    mask = (torch.rand(t, 1, generator=gen) > 0.1).double()
    return [x.to(device) for x in (hidden, weight, mask)], TopKTeacher(ids.to(device), logprobs.float().to(device))


def _head_draws_teacher(args, device, head: int, draws: int) -> SampledTeacher:
    """The head + draws rows ``[T, 1, head + draws]`` of a full teacher (its logits ``[T, 1, V]`` made on the
    device), with their weights, as the cache writes and the reader reads them."""
    from megatron_kd_plugin.cache.kinds.draws import draw_uniforms
    from megatron_kd_plugin.cache.kinds.head_draws import head_draw_weights, vocab_parallel_head_draws

    gen = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn(args.tokens, 1, args.vocab, generator=gen, device=device) * 2
    rows = vocab_parallel_head_draws(logits, draw_uniforms(1, 0, 1, args.tokens, draws).to(device), head)
    return SampledTeacher(rows.ids.to(torch.int32), rows.logprobs.float(), head_draw_weights(rows.logprobs, head))


def _run(hidden, weight, mask, teacher, **options):
    """(loss_sum, dX, dW) of one forward + backward."""
    from megatron_kd_plugin.loss import topk_kd_loss

    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    result = topk_kd_loss(hidden, weight, teacher, loss_mask=mask, validate=False, **options)
    result.loss_sum.backward()
    return result.loss_sum.detach(), hidden.grad, weight.grad


def _error(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _layout(c: int, vocab: int) -> str:
    """How the Triton row-stats kernel cuts a chunk of c rows: splits a row, and BLOCK_V tiles a split."""
    from megatron_kd_plugin.kernels import triton_kernels

    k = triton_kernels._kernels(triton_kernels.interpreting())
    splits, span = triton_kernels._split_span(c, vocab, k.min_span, k.target_programs)
    block = k.fixed.get("BLOCK_V")
    tiles = f"{-(-span // block)} tiles" if block else f"{-(-span // 8192)}-{-(-span // 2048)} tiles"
    return f"c={c:,}: {splits} split(s) x {tiles}"


def main(argv=None) -> int:
    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES

    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_loss_check: no CUDA device (on CPU: --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    chunk_tokens = [int(c) for c in args.chunk_tokens.split(",")]
    print(f"Fused loss vs float64, V={args.vocab:,}, H={args.hidden:,}, T={args.tokens:,}, forward KL (top-K: ghost "
          f"tail; head + draws: sampled), {device.type}, torch {torch.__version__}; error = max|got - ref| / max|ref|")
    print("| teacher | dtype | chunk (Triton) | variant | loss err | dX err | dW err | bound | s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    worst, broken = 0.0, []
    cases = [(f"top-{args.k}", "ghost", name) for name in args.dtypes.split(",")]
    if args.head_draws:
        head, draws = (int(n) for n in args.head_draws.split(","))
        cases.append((f"top-{head} + {draws} draws", "sampled", "bf16"))
    for teacher_name, tail, name in cases:
        dtype = dtypes[name]
        (hidden, weight, mask), teacher = _inputs(args, dtype, device)
        if tail == "sampled":
            teacher = _head_draws_teacher(args, device, head, draws)
        exact = [x.double() for x in (hidden, weight, mask)]
        ref = _run(*exact, type(teacher)(*(x.double() if x.is_floating_point() else x for x in teacher)),
                   impl="dense", tail=tail)
        assert all(float(r.abs().max()) > 0 for r in ref), "a zero reference cannot check anything"
        del exact
        for c in chunk_tokens:
            chunk_bytes = c * args.vocab * dtype.itemsize if c else None
            rows = min(c or DEFAULT_CHUNK_BYTES[device.type] // (args.vocab * dtype.itemsize), args.tokens)
            layout = _layout(rows, args.vocab)
            for kernels, mode in VARIANTS if c == 0 else [v for v in VARIANTS if v[0] == "triton"]:
                start = time.perf_counter()
                got = _run(hidden, weight, mask, teacher, impl="fused", kernels=kernels, mode=mode,
                           chunk_bytes=chunk_bytes, tail=tail)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                errors = [_error(g, r) for g, r in zip(got, ref)]
                ok = max(errors) <= BOUNDS[dtype]
                worst = max(worst, max(errors) / BOUNDS[dtype])
                if not ok:
                    broken.append(f"{teacher_name} {name} c={c} {kernels}_{mode}")
                print(f"| {teacher_name} | {name} | {layout} | {kernels}_{mode} | "
                      + " | ".join(f"{e:.2e}" for e in errors)
                      + f" | {BOUNDS[dtype]:.0e}{'' if ok else ' OVER'} | {time.perf_counter() - start:.2f} |")
        del hidden, weight, mask, teacher, ref
    print(f"result: correctness {'ok' if not broken else 'FAILED: ' + ', '.join(broken)}: the worst error is "
          f"{worst:.2f}x its bound (V={args.vocab:,}, T={args.tokens:,}, {args.dtypes}, chunks {args.chunk_tokens})")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
