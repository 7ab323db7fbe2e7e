"""GPU check of the fused teacher head (tools/gpu_check.sh's ``head`` stage): the cache command's top-K head against
``torch.topk`` over the full bf16 logits, on one GPU (TP = 1), at gpt-oss's V = 201,088 and H = 2,880.

Both get the same random final hidden states x ``[T, 1, H]`` and lm_head ``w`` ``[V, H]`` in bf16 (w scaled by
1/sqrt(H), x by 4: logits of a peaked teacher's spread). The fused head is ``writer.teacher_rows`` on
``teacher_head.TeacherHidden`` (the store's top-K rows, block by block under the default 1 GiB budget: no ``[T, V]``
tensor); the reference forms ``logits = x @ wᵀ`` ``[T, V]`` bf16 in one GEMM and takes ``torch.topk(logits, K + 1)``
(out of memory is a result). Per T: milliseconds (CUDA events, after a warm-up at 1,024 tokens), the peak memory
above the inputs (``max_memory_allocated``), and the share of tokens whose K ids are the reference's, over the
tokens whose K-th and (K+1)-th reference logits differ (a tie at bf16 has no single answer).

    python tools/gpu_teacher_head_check.py                                   # on the GPU, T = 32K and 128K
    python tools/gpu_teacher_head_check.py --device cpu --tokens 96 --vocab 1000 --hidden 32   # CPU rehearsal

Exit status 1 when the fused head's ids differ from the reference's at more than 1 % of the untied tokens.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.teacher_head import TeacherHidden
from megatron_kd_plugin.cache.writer import teacher_rows

MIN_SAME_IDS = 0.99
"""The share of untied tokens whose K ids must equal the reference's."""


class Clock:
    """Wall time of a block on ``device``: CUDA events on a GPU, ``perf_counter`` on CPU; seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.start = time.perf_counter()
        return self

    def __exit__(self, *_):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.begin.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.start


def peak_above(device: torch.device, fn):
    """(fn's result, bytes allocated at fn's peak above what was allocated before it; None on CPU)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base


def fused_ids(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``[T, K]``: the fused head's top-K ids of hidden states ``x`` ``[T, 1, H]`` (the store's rows)."""
    spec = fmt.CacheSpec(k=k, vocab_size=w.shape[0], seq_length=x.shape[0], num_samples=1)
    rows, _ = teacher_rows(TeacherHidden(hidden=x, weight=w, vocab_size=w.shape[0]), spec, first_sample=0,
                           tp_group=None)
    return rows[fmt.IDS][:, 0].long()


def reference_topk(x: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values ``[T, K+1]``, ids ``[T, K+1]``) of ``torch.topk`` over the full logits ``x @ wᵀ`` ``[T, V]``."""
    logits = torch.matmul(x[:, 0], w.t())
    return torch.topk(logits, k + 1, dim=-1)


def same_ids(fused: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[float, int]:
    """(share of untied tokens whose K ids equal the reference's as sets, untied tokens)."""
    untied = values[:, k - 1] > values[:, k]
    equal = (fused.sort(-1).values == ids[:, :k].sort(-1).values).all(-1)
    return float(equal[untied].float().mean()) if untied.any() else 1.0, int(untied.sum())


def check(tokens: int, *, hidden: int, vocab: int, k: int, device: torch.device) -> tuple[str, bool]:
    """One table row of T = ``tokens`` and whether the fused ids pass (``MIN_SAME_IDS``)."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = (4 * torch.randn(tokens, 1, hidden, generator=gen, device=device)).bfloat16()            # [T, 1, H]
    w = (torch.randn(vocab, hidden, generator=gen, device=device) / hidden ** 0.5).bfloat16()    # [V, H]
    with Clock(device) as fused_clock:
        ids, fused_peak = peak_above(device, lambda: fused_ids(x, w, k))
    gib = (lambda b: "n/a (CPU)" if b is None else f"{b / 2**30:.2f}")
    try:
        with Clock(device) as reference_clock:
            (values, reference), reference_peak = peak_above(device, lambda: reference_topk(x, w, k))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return (f"| {tokens:,} | {fused_clock.seconds * 1e3:.1f} | {gib(fused_peak)} | out of memory | - | - | - |",
                True)
    share, untied = same_ids(ids, values, reference, k)
    ratio = fused_clock.seconds / reference_clock.seconds
    return (f"| {tokens:,} | {fused_clock.seconds * 1e3:.1f} | {gib(fused_peak)} | {reference_clock.seconds * 1e3:.1f}"
            f" | {gib(reference_peak)} | {ratio:.2f} | {share:.4f} of {untied:,} |", share >= MIN_SAME_IDS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--vocab", type=int, default=201_088)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_teacher_head_check: no CUDA device (use --device cpu with small sizes)", file=sys.stderr)
        return 2
    check(min(1024, min(args.tokens)), hidden=args.hidden, vocab=args.vocab, k=args.k, device=device)   # warm-up
    print(f"fused teacher head vs torch.topk over full bf16 logits: V = {args.vocab:,}, H = {args.hidden:,}, "
          f"K = {args.k}, {device}", flush=True)
    print("| T | fused ms | fused peak GiB | topk ms | topk peak GiB | fused / topk time | same ids (untied) |\n"
          "|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    ok = True
    for tokens in args.tokens:
        row, passed = check(tokens, hidden=args.hidden, vocab=args.vocab, k=args.k, device=device)
        print(row, flush=True)
        ok &= passed
    print(f"result: fused teacher head ids {'equal' if ok else 'DIFFER from'} torch.topk's at >= "
          f"{MIN_SAME_IDS:.0%} of untied tokens at every T", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
