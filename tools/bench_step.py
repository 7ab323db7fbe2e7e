"""The whole KD training step's peak memory: a megatron-core GPTModel student's forward + backward + loss, per loss.

    python tools/bench_step.py                      # CPU: H=256, V=17,920 (V/H = 70), 2 layers, T = 2K..16K
    python tools/bench_step.py --heads 8 --groups 4 --kv-channels 64 --qk-norm    # Qwen3's proportions at H=256
    python tools/bench_step.py --device cuda --hidden 2880 --vocab 201088 --heads 40 --groups 8 --ffn 2880 \\
        --seq-lengths 32768 --one-process --variants fused_grad_in_forward,fused_recompute,forward_chunked,dense
                                                       # one H200, gpt-oss vocabulary and width (gpu_check.sh)

Every (variant, T) runs in a fresh child process (``--one-process``: one after the other in this process, the
memory freed between them; an out-of-memory variant is a result, not a crash): it builds the teacher inputs,
resets the peak, builds the student (a megatron-core GPTModel with local layers: RMSNorm, SwiGLU, RoPE, GQA, QK
norms with ``--qk-norm``, no Transformer Engine; its core-attention slot filled by torch's causal
``scaled_dot_product_attention``, whose flash/memory-efficient kernels keep no [s, s] scores, as TE's attention
does not), runs forward + loss + backward once, and reports the peak above the pre-model baseline: weights +
activations + the loss head + the lm_head's gradient (no optimizer state). Peak memory is the kernel's high-water
mark of the resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the inputs exist, with big
allocations forced through mmap by ``MALLOC_MMAP_THRESHOLD_`` so freed memory leaves the resident set) on CPU, and
``torch.cuda.max_memory_allocated`` on a GPU. Each result is printed as a table row as it ends, next to the
planner's prediction for it (:func:`predictions`).

Variants (the student's final hidden states reach each through GPTModel's ``output_processor``):
  student_only           no lm_head and no loss (backward of hidden.sum()): the floor set by weights and activations
  dense                  ``topk_kd_loss(impl="dense")``: the [T, V] teacher grid and full student logits
  megatron_peer          megatron-core's ``megatron.training.distillation.cached_logits_loss.topk_kl_div`` (ghost
                         token) on the full logits from the model's own output layer, as Megatron-LM runs it
  forward_chunked        ``topk_kd_loss(impl="forward_chunked")``: full logits, teacher kept sparse
  fused_recompute        ``topk_kd_loss(impl="fused", mode="recompute")``: no [T, V] tensor
  fused_grad_in_forward  ``topk_kd_loss(impl="fused", mode="grad_in_forward")``
All KD losses: ghost tail, forward KL, K teacher ids per token, loss mask all ones.

The prediction (``python -m megatron_kd_plugin plan``'s formulas, ``megatron_kd_plugin.commands.plan``, at this
shape with local layers, no optimizer, plain autograd): weights + the lm_head's gradient (loss variants) + the
activations the forward keeps + the larger of the loss head and the layers' backward working set. It needs no
Megatron-Bridge, so the GPU machine prints it too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("student_only", "dense", "megatron_peer", "forward_chunked", "fused_recompute", "fused_grad_in_forward")
LOSS_IMPLS = {"dense": "dense", "megatron_peer": "megatron_peer", "forward_chunked": "forward_chunked",
              "fused_recompute": "fused", "fused_grad_in_forward": "fused"}


def _layer(args):
    from megatron_kd_plugin.commands.plan import LayerShape

    return LayerShape(hidden=args.hidden, heads=args.heads, head_dim=args.kv_channels or args.hidden // args.heads,
                      groups=args.groups, ffn=args.ffn, gated=True, qk_norm=args.qk_norm, impl="local",
                      fused_norm=args.device == "cuda")


def _parameters(args) -> int:
    """The student's parameters: two embeddings (untied), the layers (QKV, projection, SwiGLU, norms), final norm."""
    layer = _layer(args)
    q, g = layer.heads * layer.head_dim, layer.groups * layer.head_dim
    per_layer = args.hidden * (q + 2 * g) + q * args.hidden + 3 * args.hidden * args.ffn + 2 * args.hidden
    return 2 * args.vocab * args.hidden + args.layers * (per_layer + (2 * layer.head_dim if args.qk_norm else 0)) + (
        args.hidden)


def predictions(args, seq: int) -> dict[str, float]:
    """The planner's bytes for each variant at one T (module docstring), from its formulas at this shape."""
    from megatron_kd_plugin.commands.plan import (LossHeadShape, backward_bytes_per_token, layer_bytes_per_sequence,
                                                  layer_bytes_per_token, loss_head_bytes,
                                                  outside_layers_bytes_per_token)
    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES

    a = 2 if args.device == "cuda" else 4
    layer, tokens = _layer(args), seq * args.micro_batch
    layers = args.layers * (tokens * layer_bytes_per_token(layer, a) + layer_bytes_per_sequence(layer, a, seq))
    backward = tokens * backward_bytes_per_token(layer, a)
    heads = loss_head_bytes(LossHeadShape(tokens=tokens, hidden=args.hidden, vocab=args.vocab,
                                          vocab_per_rank=args.vocab, k=args.k, activation_bytes=a,
                                          chunk_bytes=args.chunk_bytes or DEFAULT_CHUNK_BYTES[args.device]),
                            transient_dw=False)
    weights = _parameters(args) * a
    predicted = {"student_only": weights + layers + tokens * outside_layers_bytes_per_token(
        layer, a, loss_keeps_hidden=False) + backward}
    kept = weights + args.vocab * args.hidden * a + layers + tokens * outside_layers_bytes_per_token(layer, a)
    for variant, impl in LOSS_IMPLS.items():
        predicted[variant] = kept + max(heads[impl], backward)
    return predicted


def _reset_peak(device) -> int:
    """Reset the peak-memory counter; returns the current memory in bytes (the baseline the peak is taken above)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _peak(device) -> int:
    """Peak memory in bytes since the last :func:`_reset_peak`."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _causal_sdpa_attention():
    """megatron-core's core-attention slot filled by torch's causal scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    class CausalSDPA(torch.nn.Module):
        def __init__(self, *, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
            super().__init__()
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            # query [s, b, np, hn], key/value [s, b, ng, hn] -> context [s, b, np * hn]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, heads, s, hn]
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return CausalSDPA


def _init_single_process(device) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, seed_model_parallel

    apply_cpu_workarounds()
    if device.type == "cuda":
        torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    parallel_state.initialize_model_parallel()
    seed_model_parallel(0)


def _build_student(args, seq_length, dtype):
    """A megatron-core GPTModel (TP=1, local layers, causal SDPA core attention) of the benchmark's shape."""
    from megatron.core.models.gpt import GPTModel

    from megatron_kd_plugin.cpu_compat import local_block_spec
    from megatron_kd_plugin.models.gpt import GPTSpec, transformer_config

    spec = GPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                   num_query_groups=args.groups, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                   seq_length=seq_length, normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
    config = transformer_config(spec, tp_size=1, params_dtype=dtype)
    config.kv_channels = args.kv_channels or config.kv_channels            # Qwen3: heads x head_dim > H
    config.qk_layernorm = args.qk_norm
    block = local_block_spec(config)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _causal_sdpa_attention()
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=args.vocab, max_sequence_length=seq_length,
                    parallel_output=True, share_embeddings_and_output_weights=False, position_embedding_type="rope")


def _loss_processor(variant: str, chunk_bytes: int | None):
    """The ``output_processor`` of one variant: final hidden states [s, b, H] + lm_head -> a scalar to backward."""
    from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss

    def processor(*, hidden_states, output_layer, output_weight, context, **_):
        if variant == "student_only":
            return hidden_states.float().sum()
        if variant == "megatron_peer":
            from megatron.training.distillation.cached_logits_loss import topk_kl_div

            logits, _ = output_layer(hidden_states, weight=output_weight)               # [s, b, V]
            per_token = topk_kl_div(logits, context["teacher_logprobs"], context["teacher_ids_long"], 1, 0, None,
                                    add_ghost_token=True)                              # [b, s]
            return (per_token * context["loss_mask"].t()).sum()
        options = dict(impl="fused", chunk_bytes=chunk_bytes)
        if variant in ("dense", "forward_chunked"):
            options["impl"] = variant
        else:
            options["mode"] = variant.removeprefix("fused_")
        weight = output_weight if output_weight is not None else output_layer.weight   # [V, H]
        teacher = TopKTeacher(context["teacher_ids"], context["teacher_logprobs"])
        return topk_kd_loss(hidden_states, weight, teacher, loss_mask=context["loss_mask"], validate=False,
                            **options).loss_sum

    return processor


def run_variant(args, variant: str, seq: int) -> dict:
    """One variant at one sequence length in this process (``_init_single_process`` done): peak bytes above the
    pre-model baseline, seconds, parameters; an out-of-memory run is a result (``error="OOM"``), its memory freed."""
    import gc

    import torch

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, k = args.micro_batch, args.k
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (b, seq), generator=gen).to(device)
    position_ids = torch.arange(seq, device=device).expand(b, seq)
    teacher_ids = torch.randint(0, args.vocab, (seq, b, k), generator=gen, dtype=torch.int32)
    context = dict(
        teacher_ids=teacher_ids.to(device),                                             # [s, b, K]
        teacher_ids_long=teacher_ids.long().to(device) if variant == "megatron_peer" else None,
        teacher_logprobs=((torch.randn(seq, b, k, generator=gen) * 2).log_softmax(-1) - 0.1).to(device),  # mass 0.9
        loss_mask=torch.ones(seq, b, device=device),
    )
    gc.collect()
    base = _reset_peak(device)
    start = time.perf_counter()
    model = loss = None
    try:
        model = _build_student(args, seq, dtype).to(device)   # megatron-core's torch-norm fallback builds on CPU
        loss = model(tokens, position_ids, None, output_processor=_loss_processor(variant, args.chunk_bytes),
                     output_processor_context=context)
        loss.backward()
        peak, error = _peak(device) - base, None
    except torch.OutOfMemoryError:
        peak, error = float("nan"), "OOM"
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    del model, loss, context
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(variant=variant, seq=seq, tokens=seq * b, peak=peak, seconds=seconds, params=params, error=error)


def child(args) -> None:
    """One variant at one sequence length in a fresh process: prints a JSON line (``run_variant``'s result)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    _init_single_process(torch.device(args.device))
    print(json.dumps(run_variant(args, args.child, args.seq)))


def _spawn(variant: str, seq: int, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--child", variant, "--seq", str(seq)] + [
        f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
        ("device", "hidden", "vocab", "heads", "groups", "ffn", "layers", "micro_batch", "k", "threads",
         "chunk_bytes", "kv_channels") if getattr(args, name) is not None] + (["--qk-norm"] if args.qk_norm else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
        return dict(variant=variant, seq=seq, tokens=seq * args.micro_batch, peak=float("nan"),
                    seconds=float("nan"), error="killed (out of memory?)" if done.returncode < 0 else tail)
    return json.loads(lines[-1])


def _gib(n: float) -> str:
    return "-" if n != n else f"{n / 2**30:.3f}"


def _table(results: dict, args, seqs: list[int]) -> str:
    """Markdown: peak GiB per variant and T, growth per 1K tokens, ratios to dense and to the peer at the largest T."""
    tokens = [s * args.micro_batch for s in seqs]
    top, nan = seqs[-1], float("nan")
    lines = [f"| variant | " + " | ".join(f"T={t:,}" for t in tokens) + " | MiB per 1K tokens | / dense | / peer "
             f"| s at T={tokens[-1]:,} |", "|---|" + "---:|" * (len(tokens) + 4)]
    for variant in [v for v in VARIANTS if any((v, s) in results for s in seqs)]:
        cells = [results.get((variant, s)) for s in seqs]
        peaks = [c["peak"] if c and c.get("error") is None else float("nan") for c in cells]
        measured = [(t, p) for t, p in zip(tokens, peaks) if p == p]
        growth = ((measured[-1][1] - measured[0][1]) / (measured[-1][0] - measured[0][0]) * 1024 / 2**20
                  if len(measured) > 1 else float("nan"))
        ref = {name: results.get((name, top), {}).get("peak", float("nan")) for name in ("dense", "megatron_peer")}
        ratio = lambda r: "-" if r != r or peaks[-1] != peaks[-1] else f"{peaks[-1] / r:.3f}"  # noqa: E731
        shown = [_gib(p) if p == p else (c or {}).get("error", "not run") for p, c in zip(peaks, cells)]
        seconds = (cells[-1] or {}).get("seconds", nan)
        lines.append(f"| {variant} | " + " | ".join(shown) + f" | {'-' if growth != growth else f'{growth:.1f}'} "
                     f"| {ratio(ref['dense'])} | {ratio(ref['megatron_peer'])} | "
                     f"{'-' if seconds != seconds else f'{seconds:.1f}'} |")
    return "\n".join(lines)


def _planner_check(results: dict, predicted: dict, seqs: list[int]) -> str:
    """Markdown: the planner's prediction / the measured peak per variant and T."""
    lines = ["", "", "Planner (`python -m megatron_kd_plugin plan`'s formulas at this shape, local layers, no "
             "optimizer) / measured:", "", "| variant | " + " | ".join(f"s={s:,}" for s in seqs) + " |",
             "|---|" + "---:|" * len(seqs)]
    for variant in [v for v in VARIANTS if any((v, s) in results for s in seqs)]:
        cells = []
        for s in seqs:
            peak = results.get((variant, s), {}).get("peak", float("nan"))
            cells.append(f"{predicted[s][variant] / peak:.2f}" if peak > 0 else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(result: dict, predicted: float) -> str:
    """One result as it ends: a figure line of tools/gpu_check.sh's summary."""
    peak, error = result.get("peak", float("nan")), result.get("error")
    measured = error or f"{_gib(peak)} GiB"
    ratio = "-" if error or not peak > 0 else f"{predicted / peak:.2f}"
    seconds = result.get("seconds", float("nan"))
    return (f"| step | {result['variant']} | s={result['seq']:,} | {measured} | planner {_gib(predicted)} GiB | "
            f"x{ratio} | {'-' if seconds != seconds else f'{seconds:.1f} s'} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--hidden", type=int, default=256, help="student width H")
    parser.add_argument("--vocab", type=int, default=17920, help="vocabulary V (V/H = 70 by default, as gpt-oss)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--groups", type=int, default=2, help="query groups (GQA)")
    parser.add_argument("--ffn", type=int, default=768, help="SwiGLU inner width")
    parser.add_argument("--kv-channels", type=int, default=None, help="head width (default H / heads)")
    parser.add_argument("--qk-norm", action="store_true", help="RMSNorm on Q and K (Qwen3)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--k", type=int, default=100, help="teacher ids per token")
    parser.add_argument("--seq-lengths", default="2048,4096,8192,16384", help="sequence lengths s (T = s * b)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch b")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="fused chunk budget (default: the loss's)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads in each child")
    parser.add_argument("--one-process", action="store_true",
                        help="every run in this process, in the order given (a GPU: no start-up per run)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.one_process and args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable, __file__, *(argv or sys.argv[1:])],
                  dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))    # freed memory must leave the resident set
    seqs = sorted(int(s) for s in args.seq_lengths.split(",") if s)
    predicted = {s: predictions(args, s) for s in seqs}
    if args.one_process:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        _init_single_process(torch.device(args.device))
    print("| step | variant | s | peak | planner | planner / peak | time |\n|---|---|---|---:|---:|---:|---:|",
          flush=True)
    started, results, failed = time.monotonic(), {}, set()
    for seq in seqs:
        for variant in variants:
            if variant in failed:                       # out of memory at a shorter T: longer ones fail too
                results[variant, seq] = dict(variant=variant, seq=seq, error="skipped: out of memory at a shorter s")
            elif args.budget_s is not None and time.monotonic() - started > args.budget_s:
                results[variant, seq] = dict(variant=variant, seq=seq, error=f"skipped: budget {args.budget_s:g} s")
            else:
                results[variant, seq] = (run_variant(args, variant, seq) if args.one_process
                                         else _spawn(variant, seq, args))
                if results[variant, seq].get("error"):
                    failed.add(variant)
            print(_row(dict(results[variant, seq], variant=variant, seq=seq), predicted[seq][variant]), flush=True)
    params = next((r["params"] for r in results.values() if r.get("params")), 0)
    header = (f"Whole KD step (student forward + loss + backward) peak GiB above the pre-model baseline, "
              f"{args.device}: {args.layers}-layer GPTModel H={args.hidden} ({args.heads} heads of "
              f"{args.kv_channels or args.hidden // args.heads}, {args.groups} groups"
              f"{', QK norm' if args.qk_norm else ''}"
              f", SwiGLU {args.ffn}), V={args.vocab:,} (V/H = {args.vocab / args.hidden:.0f}), "
              f"{params / 1e6:.1f} M parameters, K={args.k}, b={args.micro_batch}, "
              f"{'bf16' if args.device == 'cuda' else 'fp32'}; {os.cpu_count()} cores, torch threads "
              f"{args.threads or 'default'}, load average {os.getloadavg()[0]:.1f}")
    table = _table(results, args, seqs) + _planner_check(results, predicted, seqs)
    print("\n" + header + "\n\n" + table)
    if args.out:
        with open(args.out, "w") as out:
            out.write(header + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
