"""The fused teacher head against today's whole-logits head, side by side in one run (``tools/bench_teacher_head.py``).

Both heads get the same final hidden states ``[T, 1, H]`` and lm_head shard ``[V/tp, H]`` (random, fp32 on CPU) and
write the same store kind's rows (``writer.teacher_rows``): the fused head block by block (``teacher_head.py``), the
whole head from the ``[T, V/tp]`` logits of one GEMM (what the output layer formed before). Each case runs in a fresh
process per rank (gloo for TP > 1): the figure is the peak RSS (VmHWM, reset once the inputs are allocated) above the
RSS at that point (after one 8-token warm-up of the same head, so the first call's code pages and thread pools are
not counted). Also timed, after the peak is read: the bare GEMM that forms the logits (in blocks of 4,096 tokens),
so the head's time reads as an overhead over the output layer of a plain teacher forward.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Resets the kernel's peak RSS of this process (VmHWM) to its current RSS (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _case(rank: int, tp: int, port: int, head: str, tokens: int, hidden: int, vocab: int, k: int,
          chunk_bytes: int, out) -> None:
    """One rank of one case: {"seconds", "peak_bytes", "gemm_seconds"} put on ``out``."""
    torch.set_num_threads(1)
    if tp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron_kd_plugin.cache.store.format import CacheSpec
    from megatron_kd_plugin.cache.teacher_head import TeacherHidden, mask_padded_vocab
    from megatron_kd_plugin.cache.writer import teacher_rows

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, 1, hidden, generator=gen)                                # [T, 1, H]
    w = torch.randn(vocab // tp, hidden, generator=gen) / hidden ** 0.5              # [V/tp, H]
    spec = CacheSpec(k=k, vocab_size=vocab, seq_length=tokens, num_samples=1)
    group = dist.group.WORLD if tp > 1 else None

    def run(x: torch.Tensor, spec: CacheSpec) -> None:
        if head == "fused":
            teacher_rows(TeacherHidden(hidden=x, weight=w, vocab_size=vocab, tp_rank=rank), spec, first_sample=0,
                         tp_group=group, chunk_bytes=chunk_bytes)
        else:
            logits = mask_padded_vocab(torch.matmul(x, w.t()), vocab, rank)           # [T, 1, V/tp]
            teacher_rows(logits, spec, first_sample=0, tp_group=group, chunk_bytes=2**62)

    run(x[:8], CacheSpec(k=k, vocab_size=vocab, seq_length=8, num_samples=1))   # loads the ops' code and pools
    if tp > 1:
        dist.barrier()
    base = _rss_bytes()
    _reset_peak_rss()                              # the imports' and the warm-up's peak is not the head's
    begin = time.perf_counter()
    run(x, spec)
    seconds = time.perf_counter() - begin
    peak = _peak_rss_bytes() - base
    begin = time.perf_counter()
    for block in x.split(4096):                    # the output layer's GEMM, after the peak is read (it is not kept)
        torch.matmul(block, w.t())
    gemm = time.perf_counter() - begin
    out.put((rank, {"seconds": seconds, "peak_bytes": peak, "gemm_seconds": gemm}))
    if tp > 1:
        dist.destroy_process_group()


def run_case(head: str, *, tokens: int, hidden: int, vocab: int, k: int = 100, tp: int = 1,
             chunk_bytes: int = 2**28) -> dict:
    """``head`` ("fused" or "whole") on ``tokens`` tokens in fresh processes: rank 0's figures (module docstring)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_case, args=(r, tp, port, head, tokens, hidden, vocab, k, chunk_bytes, out))
             for r in range(tp)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join()
    return results[0]


def compare(*, tokens: int, hidden: int, vocab: int, tp: int = 1, k: int = 100, whole: bool = True,
            chunk_bytes: int = 2**28) -> dict:
    """{"fused": figures, "whole": figures or None} of one T; ``whole`` False skips today's head (it would not fit)."""
    fused = run_case("fused", tokens=tokens, hidden=hidden, vocab=vocab, k=k, tp=tp, chunk_bytes=chunk_bytes)
    today = run_case("whole", tokens=tokens, hidden=hidden, vocab=vocab, k=k, tp=tp) if whole else None
    return {"tokens": tokens, "tp": tp, "fused": fused, "whole": today}


def format_row(result: dict, vocab: int) -> str:
    """One markdown table row of :func:`compare`'s result."""
    fused, today, t = result["fused"], result["whole"], result["tokens"]
    gib = 2.0 ** 30
    whole_logits = t * (vocab // result["tp"]) * 4 / gib
    cells = [f"{t // 1024}K", str(result["tp"]), f"{fused['peak_bytes'] / gib:.3f}"]
    if today is None:
        cells += [f"not run ({whole_logits:.1f} GiB of logits)", "-", "-"]
    else:
        cells += [f"{today['peak_bytes'] / gib:.3f}", f"{fused['peak_bytes'] / today['peak_bytes']:.3f}",
                  f"{today['seconds'] / fused['seconds']:.2f}"]
    cells += [f"{t / fused['seconds']:,.0f}", f"{fused['seconds'] / fused['gemm_seconds']:.2f}"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| T | TP | fused peak GiB | today's peak GiB | memory fused / today's | tokens/s fused / today's | "
          "fused tokens/s | fused head time / logits GEMM |\n|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--chunk-bytes", type=int, default=2**28)
    p.add_argument("--whole-up-to", type=int, default=16384, help="largest T today's head runs at (RAM)")
    args = p.parse_args(argv)
    print(HEADER)
    for tp in args.tp:
        for tokens in args.tokens:
            result = compare(tokens=tokens, hidden=args.hidden, vocab=args.vocab, tp=tp, k=args.k,
                             whole=tokens <= args.whole_up_to, chunk_bytes=args.chunk_bytes)
            print(format_row(result, args.vocab), flush=True)
            print(json.dumps(result), file=__import__("sys").stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
