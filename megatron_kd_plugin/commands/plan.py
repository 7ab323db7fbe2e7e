"""What a KD run needs per GPU, by component, and whether it fits: ``python -m megatron_kd_plugin plan``.

    python -m megatron_kd_plugin plan --recipe qwen3_8b_to_0p6b_kd_768k_1gpu_h200_bf16_config [overrides] \\
        [--hf-path STUDENT] [--gpu-memory 140]
    python -m megatron_kd_plugin plan --published [--hf-path QWEN3_1P7B]   # gpt-oss vocabulary, 32K x 4 tokens
    python -m megatron_kd_plugin plan --cache --teacher HF_DIR --seq-length 32768 --tp 2 --ep 4 [cache flags]

``--cache`` plans the cache command instead (``megatron_kd_plugin/cache/cache_plan.py``: weights, one layer's forward,
the fused head's block, the writer's shard buffer), from the teacher folder's config.json and the cache command's
flags of the same names.

The recipes take the student's architecture from its HF checkpoint (``--hf-path``: a folder, of which only
config.json is read, or a hub id, fetched like the train command fetches it).

Model state comes from Megatron-Bridge's estimator (``estimate_training_memory`` through ``models.hf.
estimate_model_state``, which counts every gated MLP with three projections: parameters on the most loaded shard; 2 B weights + 4 B fp32 gradients + 12 B Adam state per parameter, the Adam state sharded with the
distributed optimizer); this module splits it into weights / gradients / optimizer. Activations are counted here,
per layer, from what megatron-core's layers save for their backward (Bridge's Korthikanti et al. formula,
18·H + 4·F bytes per token at bf16, assumes a plain GPT layer: it misses the SwiGLU's doubled fc1, the wider query
projection of Qwen3 (heads x head_dim > H), its QK norms, and the unfused norms of local layers; it was 0.56x the
measured peak of the CPU benchmark's student).

Per token and layer, in elements of the activation dtype (a = 2 B bf16, 4 B fp32), with H the width, Hq = heads x
head_dim, G = query groups x head_dim, F the MLP width, all divided by TP (H only with sequence parallelism):

  saved for backward            local layers (measured, CPU)             Transformer Engine (analytic)
  norm + the linear after it    3H each: input, normalised, linear in;   2H each: input, normalised (fused
   (twice)                      2H with a fused norm (LayerNorm; torch's  LayerNormLinear)
                                RMSNorm on CUDA)
  attention                     3Hq + 3G: the QKV projection's output (V, a view of it, keeps it), rotated Q
                                and K, the core's output; no [s, s] scores (flash, SDPA or TE attention; megatron-
                                core's local DotProductAttention would keep two [b, heads, s, s] and is not planned)
  QK norm (Qwen3)               Hq: Q's copy (its norm's input); with the unfused norm also Q and K normalised
                                (+ Hq + G)
  MLP                           SwiGLU 5F (fc1's 2F, SiLU's, the gate     SwiGLU 3F (fc1's 2F for megatron's
                                product's, fc2's input: megatron's        fused bias-SwiGLU, fc2's input); GeLU
                                fusions off, as on CPU); GeLU 2F          2F
  per sequence                  RoPE's cos and sin of Q and K: 4·s·hd     (fused RoPE: one shared table)
  plus fp32 statistics: 4 B per head (the attention's log-sum-exp) and per norm row (rstd; QK norms: per head).

Local layers on CPU: ``tests/test_memory_plan.py`` counts every tensor megatron-core saves and holds this table to
it exactly; ``tools/bench_step.py`` holds the whole step to the measured peak (docs/long-context.md). Transformer Engine's
column is read off its code (``LayerNormLinear`` saves input and normalised output, its attention q, k, v, output
and softmax statistics, megatron's fused bias-SwiGLU its input); no TE run checks it here.

The step's peak, for one microbatch (x the microbatches in flight with PP):
  activations       what the forward keeps for the backward: each layer's saved tensors above (recompute "full":
                    one [s, b, H] input per checkpointed group instead; "selective" recomputes the core attention,
                    which with flash attention keeps the same), the token ids (8 B), the final norm's saved input
                    and the hidden states the loss keeps
  backward          the largest working set of one layer's backward beyond that: the gradient of fc1's output (2F
                    SwiGLU, F GeLU) or of the QKV projection (Hq + 2G), whichever is larger (measured: the CPU
                    student's peak is its activations + [T, 2F]); under recompute "full" plus the recomputed
                    group's saved tensors
  loss head         the loss formulation's buffers, for the T = s·b/cp tokens of one rank (V_p = padded V / tp, K
                    teacher ids, c = the chunk budget):
    fused            c + T·H·4 (dX) + V_p·H·4 (dW, fp32 like main_grad) + 8·T·K·4 (per-token state)
    forward_chunked  2·T·V_p·4 (logits + their gradient) + dX + dW + 8·T·K·4
    megatron_peer    T·V_p·3·4 (fp32 logits, exp, log-probs; measured 12.0 B/logit) + with a = 2 B activations
                     T·V_p·2·2 (the output layer's bf16 logits and their gradient) + T·H·a; dW goes to main_grad
    dense            5.5·T·V·4 (the plugin's reference: logits, log q, the [T, V] teacher grid, gradients; measured
                     22.0 B/logit) + dX + dW
  total = weights + gradients + optimizer + activations + KD batch (T·K·(4 + 4): teacher ids and log-probs)
          + max(loss head, backward): the loss's buffers are gone before the layers' backward starts.
A GPU "fits" when the total is at most 90% of its memory (the CUDA context, the allocator's fragmentation and
kernel workspaces take the rest). The layers are Transformer Engine's when planning for CUDA (the recipes' GPU
spec) unless the config says ``transformer_impl="local"``, local on CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import re
import sys

GIB = 2**30
USABLE_FRACTION = 0.9
"""Share of a GPU's memory a plan may fill."""
DEFAULT_K = 64
"""Teacher ids per token when the config does not say (``dataset.k`` is None: read from the store)."""
LOSS_HEADS = ("fused", "forward_chunked", "megatron_peer", "dense")
LAYER_IMPLS = ("transformer_engine", "local")
PUBLISHED_CASE = ("qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config",   # planned on one GPU
                  ["model.vocab_size=201088", "model.seq_length=32768", "dataset.seq_length=32768",
                   "train.micro_batch_size=4", "model.context_parallel_size=1", "model.tensor_model_parallel_size=1",
                   "model.recompute_granularity=full", "model.recompute_method=uniform",
                   "model.recompute_num_layers=1"])
"""The published headline's shape (gpt-oss-120b's vocabulary 201,088; 32K x 4 tokens a microbatch) on one GPU, for a
Qwen3-1.7B student with full recompute."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """What one transformer layer's saved activations depend on (full widths; TP divides them)."""

    hidden: int
    """H."""
    heads: int
    """Attention heads."""
    head_dim: int
    """kv_channels."""
    groups: int
    """Query groups (GQA; = heads without it)."""
    ffn: int
    """F, the MLP's inner width."""
    gated: bool = True
    """SwiGLU (fc1 makes 2F) rather than GeLU."""
    qk_norm: bool = False
    """Norms on Q and K (Qwen3)."""
    impl: str = "transformer_engine"
    """``LAYER_IMPLS``: Transformer Engine's layers or megatron-core's local ones."""
    fused_norm: bool = True
    """Local layers: the norm saves its input only (LayerNorm; torch's RMSNorm on CUDA), not also its normalised
    output (torch's composite RMSNorm on CPU)."""

    def __post_init__(self):
        if self.impl not in LAYER_IMPLS:
            raise ValueError(f"impl={self.impl!r}: expected one of {LAYER_IMPLS}")


def layer_bytes_per_token(layer: LayerShape, a: int, *, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes per token one layer keeps for its backward (the module docstring's table, without the per-sequence
    RoPE term), on one of ``tp`` ranks."""
    h = layer.hidden / (tp if sequence_parallel else 1)
    q, g, f = layer.heads * layer.head_dim / tp, layer.groups * layer.head_dim / tp, layer.ffn / tp
    unfused_norm = layer.impl == "local" and not layer.fused_norm      # also keeps each norm's normalised output
    norms = 2 * (3 if unfused_norm else 2) * h
    qk_norm = q + (q + g if unfused_norm else 0)
    if layer.gated:
        mlp = 5 * f if layer.impl == "local" else 3 * f
    else:
        mlp = 2 * f
    elements = norms + 3 * q + 3 * g + (qk_norm if layer.qk_norm else 0) + mlp
    rows = 2 / (tp if sequence_parallel else 1) + (layer.heads + (layer.heads + layer.groups if layer.qk_norm else 0)
                                                   ) / tp     # fp32: the log-sum-exp, each norm's rstd
    return a * elements + 4 * rows


def layer_bytes_per_sequence(layer: LayerShape, a: int, seq: int) -> float:
    """Bytes one layer keeps per sequence of ``seq`` tokens whatever the batch: local layers' RoPE cos and sin."""
    return 4 * seq * layer.head_dim * a if layer.impl == "local" else 0.0


def backward_bytes_per_token(layer: LayerShape, a: int, *, tp: int = 1) -> float:
    """The largest gradient one layer's backward holds beyond what is kept: fc1's output or the QKV projection's."""
    fc1 = (2 if layer.gated else 1) * layer.ffn
    return a * max(fc1, (layer.heads + 2 * layer.groups) * layer.head_dim) / tp


def outside_layers_bytes_per_token(layer: LayerShape, a: int, *, tp: int = 1, sequence_parallel: bool = False,
                                   loss_keeps_hidden: bool = True) -> float:
    """Kept outside the layers, per token: the token ids (8 B), the final norm's saved tensors and the hidden states
    the loss keeps."""
    split = tp if sequence_parallel else 1
    norm = 2 if layer.impl == "local" and not layer.fused_norm else 1
    return 8 + a * layer.hidden / split * (norm + (1 if loss_keeps_hidden else 0)) + 4 / split


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossHeadShape:
    """What the loss head's memory depends on, for one rank and one microbatch."""

    tokens: int
    """T = s·b/cp tokens reach this rank's loss."""
    hidden: int
    """H."""
    vocab: int
    """V, the padded vocabulary."""
    vocab_per_rank: int
    """V_p = V/tp rows of the lm_head on this rank."""
    k: int
    """Teacher ids per token."""
    chunk_bytes: int
    """The fused loss's working budget c."""
    activation_bytes: int
    """a: 2 for bf16 activations, 4 for fp32."""


def loss_head_bytes(shape: LossHeadShape, *, transient_dw: bool = True) -> dict[str, float]:
    """Peak bytes of each loss formulation above the model (formulas in the module docstring).

    ``transient_dw``: the loss's dW is a buffer of its own before it reaches main_grad (Megatron's DDP); False where
    the gradient of the lm_head is the parameter's ``.grad`` itself (plain autograd, as in ``tools/bench_step.py``).
    """
    t, h, v, vp, k, a = (shape.tokens, shape.hidden, shape.vocab, shape.vocab_per_rank, shape.k,
                         shape.activation_bytes)
    dx, dw, per_token = t * h * 4, (vp * h * 4 if transient_dw else 0), 8 * t * k * 4
    return {
        "fused": shape.chunk_bytes + dx + dw + per_token,
        "forward_chunked": 2 * t * vp * 4 + dx + dw + per_token,
        "megatron_peer": t * vp * (3 * 4 + (2 * a if a == 2 else 0)) + t * h * a,
        "dense": 5.5 * t * v * 4 + dx + dw,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-GPU bytes of one KD run, by component (the most loaded rank)."""

    weights: float
    """Model parameters in their training dtype."""
    gradients: float
    """fp32 main gradients."""
    optimizer: float
    """Adam state (fp32 master copy, m, v), sharded over DP x CP with the distributed optimizer."""
    activations: float
    """What the forward of the microbatches in flight keeps for the backward, without the loss head."""
    backward: float
    """The largest working set of a layer's backward beyond ``activations`` (with recompute "full": the recomputed
    group's activations too)."""
    kd_batch: float
    """The microbatch's teacher ids and log-probs on this rank."""
    loss_head: dict[str, float]
    """Peak of each loss formulation above the model."""
    impl: str
    """The recipe's ``kd.impl``."""
    chunk_bytes: int
    """The fused loss's chunk budget c the plan used."""
    layers: str
    """The layers planned: ``LAYER_IMPLS``."""
    notes: tuple[str, ...]
    """Bridge's estimator assumptions plus this plan's."""

    def total(self, impl: str | None = None) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.kd_batch
                + max(self.loss_head[impl or self.impl], self.backward))


def _activation_bytes(cfg) -> int:
    mixed = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else ""
    return 2 if cfg.model.bf16 or cfg.model.fp16 or "bf16" in mixed or "fp16" in mixed else 4


def _padded_vocab(model) -> int:
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    if not model.should_pad_vocab:
        return model.vocab_size
    return calculate_padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                                       model.tensor_model_parallel_size, logging_enabled=False)


def layer_shape(model, device: str = "cuda") -> LayerShape:
    """The ``LayerShape`` of a model config (dense layers: MoE experts are not planned). Transformer Engine's layers
    when planning for CUDA unless ``transformer_impl="local"``; local layers on CPU (``cpu_compat``'s spec)."""
    heads = model.num_attention_heads
    local = device != "cuda" or getattr(model, "transformer_impl", "transformer_engine") == "local"
    return LayerShape(hidden=model.hidden_size, heads=heads, head_dim=model.kv_channels or model.hidden_size // heads,
                      groups=model.num_query_groups or heads, ffn=model.ffn_hidden_size,
                      gated=bool(model.gated_linear_unit), qk_norm=bool(getattr(model, "qk_layernorm", False)),
                      impl="local" if local else "transformer_engine",
                      fused_norm=model.normalization == "LayerNorm" or device == "cuda")


def _in_flight(model, num_microbatches: int | None) -> float:
    """Microbatches' worth of the whole model's layers the first pipeline stage holds (Bridge's accounting: pp
    microbatches of its L/pp layers, fewer with fewer microbatches, more with an interleaved schedule)."""
    pp, vp = model.pipeline_model_parallel_size, getattr(model, "virtual_pipeline_model_parallel_size", None)
    if vp is not None:
        return 1 + (pp - 1) / (pp * vp)
    if pp > 1 and num_microbatches is not None:
        return min(1.0, num_microbatches / pp)
    return 1.0


def _activations(cfg, layer: LayerShape, a: int, num_microbatches: int | None) -> tuple[float, float]:
    """(activations, backward) of the module docstring, for the most loaded rank."""
    model, mbs = cfg.model, cfg.train.micro_batch_size
    tp, cp, pp = model.tensor_model_parallel_size, model.context_parallel_size, model.pipeline_model_parallel_size
    sp = bool(model.sequence_parallel)
    seq = model.seq_length // cp
    tokens = seq * mbs
    per_layer = (tokens * layer_bytes_per_token(layer, a, tp=tp, sequence_parallel=sp)
                 + layer_bytes_per_sequence(layer, a, seq))
    layer_input = a * tokens * model.hidden_size / (tp if sp else 1)      # one checkpointed [s, b, H] input
    layers = model.num_layers * _in_flight(model, num_microbatches)
    backward = tokens * backward_bytes_per_token(layer, a, tp=tp)
    if model.recompute_granularity != "full":
        kept = layers * per_layer
    elif model.recompute_method == "block":                              # the first n layers of a stage recompute
        n = min(model.recompute_num_layers or 1, model.num_layers // pp) * pp
        kept = n * layer_input + (layers - n) * per_layer
        backward += per_layer
    else:                                                               # groups of g layers, each one input
        g = model.recompute_num_layers or 1
        kept = math.ceil(layers / g) * layer_input
        backward += g * per_layer
    outside = tokens * outside_layers_bytes_per_token(layer, a, tp=tp, sequence_parallel=sp)
    return kept + outside, backward


def plan_memory(cfg, *, gpus: int | None = None, num_microbatches: int | None = None, k: int | None = None,
                device: str = "cuda", with_optimizer: bool = True, transient_dw: bool = True) -> MemoryPlan:
    """The per-GPU memory of KD run ``cfg`` (a ``KDConfigContainer``) on ``gpus`` GPUs (default: TP·CP·PP, one DP
    rank); ``device`` picks the layers planned (``layer_shape``) and the loss's default chunk budget;
    ``with_optimizer`` / ``transient_dw`` False describe a bare forward + backward."""
    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES
    from megatron_kd_plugin.models.hf import check_expert_parallel, estimate_model_state

    cfg = copy.deepcopy(cfg)
    model = cfg.model
    tp, cp = model.tensor_model_parallel_size, model.context_parallel_size
    model_parallel = tp * cp * model.pipeline_model_parallel_size
    gpus = gpus or model_parallel
    if gpus % model_parallel:
        raise ValueError(f"gpus={gpus} is not a multiple of TP x CP x PP = {model_parallel}")
    check_expert_parallel(model, gpus)   # a MoE student at expert sizes megatron-core would refuse: one line
    cfg.data_parallel_size = gpus // model_parallel   # Bridge sets it at run time from the world size
    estimate = estimate_model_state(cfg, num_microbatches=num_microbatches, include_activation=False)
    a = _activation_bytes(cfg)
    params = sum(c.parameter_count_per_gpu for c in estimate.model_state_components)
    # Bridge's bytes per parameter: 2 (bf16 weights) + 4 (fp32 grads) + 12 (fp32 master, m, v) / optimizer shard
    adam = sum(c.parameter_count_per_gpu * (c.bytes_per_parameter - 6) for c in estimate.model_state_components)
    optimizer = (adam if a == 2 else adam * 8 / 12) if with_optimizer else 0.0   # fp32 weights: no master copy
    tokens = model.seq_length * cfg.train.micro_batch_size // cp
    vocab = _padded_vocab(model)
    k = k or cfg.dataset.k or DEFAULT_K
    shape = LossHeadShape(tokens=tokens, hidden=model.hidden_size, vocab=vocab, vocab_per_rank=vocab // tp, k=k,
                          chunk_bytes=cfg.kd.chunk_bytes or DEFAULT_CHUNK_BYTES[device], activation_bytes=a)
    layer = layer_shape(model, device)
    activations, backward = _activations(cfg, layer, a, num_microbatches)
    notes = estimate.assumptions + (
        f"{gpus} GPUs: TP={tp}, CP={cp}, PP={model.pipeline_model_parallel_size}, DP="
        f"{cfg.data_parallel_size}; activations of one microbatch ({cfg.train.micro_batch_size} x "
        f"{model.seq_length} tokens), recompute={model.recompute_granularity}, {layer.impl} layers (megatron-core's "
        f"saved tensors, this module's docstring).",
        "The total takes the larger of the loss head and the layers' backward working set; PP>1 adds the last "
        "stage's loss head to the first stage's activations (an upper bound).")
    return MemoryPlan(weights=params * a, gradients=params * 4, optimizer=optimizer, activations=activations,
                      backward=backward, kd_batch=tokens * k * 8,
                      loss_head=loss_head_bytes(shape, transient_dw=transient_dw), impl=cfg.kd.impl,
                      chunk_bytes=shape.chunk_bytes, layers=layer.impl, notes=notes)


def fits(plan: MemoryPlan, gpu_gib: float, impl: str | None = None) -> bool:
    """Whether ``plan`` with loss ``impl`` fits a GPU of ``gpu_gib`` GiB (``USABLE_FRACTION`` of it)."""
    return plan.total(impl) <= USABLE_FRACTION * gpu_gib * GIB


def format_plan(plan: MemoryPlan, gpu_gib: float, title: str) -> str:
    """The plan as a table: one column per loss formulation (the recipe's first), one row per component."""
    impls = [plan.impl] + [i for i in LOSS_HEADS if i != plan.impl]
    shared = [("weights", plan.weights), ("gradients", plan.gradients), ("optimizer states", plan.optimizer),
              (f"activations ({plan.layers} layers)", plan.activations),
              ("KD batch (teacher ids, log-probs)", plan.kd_batch),
              ("backward working set", plan.backward)]
    width = 44
    lines = [title, f"{'GiB per GPU':<{width}}" + "".join(f"{i:>17}" for i in impls)]
    lines += [f"{name:<{width}}" + f"{value / GIB:>17.2f}" * len(impls) for name, value in shared]
    lines.append(f"{'loss head':<{width}}" + "".join(f"{plan.loss_head[i] / GIB:>17.2f}" for i in impls))
    lines.append(f"{'total (the larger of loss head, backward)':<{width}}"
                 + "".join(f"{plan.total(i) / GIB:>17.2f}" for i in impls))
    verdict = ["fits" if fits(plan, gpu_gib, i) else "does NOT fit" for i in impls]
    margin = [f"{(USABLE_FRACTION * gpu_gib * GIB - plan.total(i)) / GIB:+.1f}" for i in impls]
    lines.append(f"{f'{gpu_gib:g} GiB GPU (90% usable)':<{width}}" + "".join(f"{v:>17}" for v in verdict))
    lines.append(f"{'margin to the 90% line':<{width}}" + "".join(f"{m:>17}" for m in margin))
    return "\n".join(lines + [f"  - {note}" for note in plan.notes + fused_head_notes(plan)])


def fused_head_notes(plan: MemoryPlan) -> tuple[str, ...]:
    """Why the fused head can be the larger one: it reserves its chunk budget c whatever T, so it is larger where
    the other formulation's [T, V_p] buffers are smaller than c (small T or V)."""
    larger_than = [impl for impl in LOSS_HEADS if plan.loss_head[impl] < plan.loss_head["fused"]]
    if not larger_than:
        return ()
    return (f"The fused loss head is larger than {', '.join(larger_than)} here: it reserves its chunk budget "
            f"c = {plan.chunk_bytes / 2**20:,.0f} MiB (kd.chunk_bytes, or the loss's default) whatever the tokens, "
            f"and at these shapes their [T, V] buffers are smaller than c; kd.chunk_bytes=N lowers it, and at "
            f"long sequences or large vocabularies the fused head is the smallest.",)


def cache_main(argv: list[str]) -> int:
    """``plan --cache``: the cache command's memory per GPU (``cache/cache_plan.py``)."""
    import torch

    from megatron_kd_plugin.cache.cache_plan import CacheLayout, format_cache_plan, plan_cache, teacher_shape
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.cache.teacher_head import DEFAULT_CHUNK_BYTES
    from megatron_kd_plugin.commands.cache import DTYPES, check_world

    p = argparse.ArgumentParser(prog="megatron_kd_plugin plan --cache", description=cache_main.__doc__)
    p.add_argument("--teacher", required=True, help="Hugging Face checkpoint folder (only config.json is read)")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per sample S")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per teacher forward")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--cp", "context"), ("--ep", "expert")):
        p.add_argument(flag, type=int, default=1, help=f"{what}-parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: the cache command's)")
    p.add_argument("--topk", type=int, default=None, help="K of a top-K store (default 100)")
    p.add_argument("--draws", type=int, default=None, help="N draws of a sampled store (instead of --topk)")
    p.add_argument("--head", type=int, default=None, help="with --draws: the exact top-H ids first")
    p.add_argument("--top-p", type=float, default=None, help="top-p store (with --topk as the cap)")
    p.add_argument("--min-k", type=int, default=None, help="a top-p store's floor")
    p.add_argument("--logprob-codec", default=None, choices=sorted(fmt.LOGPROB_CODECS))
    p.add_argument("--store-logsumexp", action="store_true")
    p.add_argument("--head-chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="the fused head's block budget")
    p.add_argument("--samples-per-shard", type=int, default=None, help="default: 2^20 / --seq-length")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(set(DTYPES) - {"auto"}),
                   help="the teacher's parameter dtype on the GPU (default bfloat16)")
    p.add_argument("--attention", default="flash", choices=["flash", "local"],
                   help="flash: Transformer Engine / flash attention (no [s, s]); local: megatron-core's (CPU)")
    p.add_argument("--gpu-memory", type=float, default=140.0, help="GPU memory in GiB (default: an H200's 140)")
    args = p.parse_args(argv)
    if args.topk is not None and args.draws is not None:
        p.error("--topk and --draws exclude each other: a store holds the top-K or N draws per token")
    try:
        from megatron_kd_plugin.models.hf import hf_model_provider

        provider = hf_model_provider(args.teacher, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                                     expert_parallel=args.ep, expert_tensor_parallel=args.etp, load_weights=False,
                                     inference=True)
        provider.context_parallel_size = args.cp
        etp = provider.expert_tensor_parallel_size
        check_world(math.lcm(args.tp * args.cp * args.pp, etp * args.ep * args.pp), tp=args.tp, pp=args.pp,
                    ep=args.ep, etp=etp, cp=args.cp)
        sampled = args.draws is not None
        slots = args.draws + (args.head or 0) if sampled else 100 if args.topk is None else args.topk
        spec = fmt.CacheSpec(k=slots, vocab_size=provider.vocab_size, seq_length=args.seq_length,
                             num_samples=args.samples_per_shard or fmt.default_samples_per_shard(args.seq_length),
                             samples_per_shard=args.samples_per_shard, mode="sampled" if sampled else "topk",
                             logprob_codec=args.logprob_codec, store_logsumexp=args.store_logsumexp,
                             top_p=args.top_p, min_k=1 if args.top_p is not None and args.min_k is None else args.min_k,
                             head=args.head or 0)
        layout = CacheLayout(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, tp=args.tp,
                             cp=args.cp, etp=etp, spec=spec, param_bytes=DTYPES[args.dtype].itemsize,
                             head_chunk_bytes=args.head_chunk_bytes, attention=args.attention)
        plan = plan_cache(teacher_shape(provider), layout)
    except ValueError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    flags = " ".join(argv)
    title = (f"cache layout: {flags}\n  {provider.num_layers} layers, H={provider.hidden_size}, V="
             f"{provider.vocab_size:,}, {spec.k} slots, {spec.samples_per_shard} samples a shard, "
             f"{args.attention} attention, {args.dtype} weights")
    print(format_cache_plan(plan, args.gpu_memory, title))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--cache" in argv:
        return cache_main([a for a in argv if a != "--cache"])
    parser = argparse.ArgumentParser(prog="megatron_kd_plugin plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="--recipe, --config-file, --hf-path, --seq-length and the overrides are "
                                            "the train command's: give the plan the arguments of the run it plans")
    from megatron_kd_plugin.commands.train import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--published", action="store_true",
                        help="the published case: gpt-oss vocabulary 201,088, 32K x 4 tokens, one GPU, "
                             f"recipe {PUBLISHED_CASE[0]} with {' '.join(PUBLISHED_CASE[1])}")
    parser.add_argument("--gpu-memory", type=float, default=140.0, help="GPU memory in GiB (default: an H200's 140)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs of the run (default: the recipe name's <N>gpu, else TP x CP x PP)")
    parser.add_argument("--k", type=int, default=None, help=f"teacher ids per token (default: dataset.k or "
                                                            f"{DEFAULT_K})")
    parser.add_argument("--num-microbatches", type=int, default=None, help="microbatches in flight (PP>1)")
    args = parser.parse_args(argv)
    if args.gpu_memory <= 0:
        parser.error(f"--gpu-memory={args.gpu_memory}: must be > 0 GiB")
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus={args.gpus}: must be >= 1")
    if args.k is not None and args.k < 1:
        parser.error(f"--k={args.k}: must be >= 1")
    if bool(args.recipe) == args.published:
        parser.error("give exactly one of --recipe NAME and --published")
    from megatron.bridge.training.utils.omegaconf_utils import OverridesError

    from megatron_kd_plugin.commands.train import build_config

    recipe, overrides = PUBLISHED_CASE if args.published else (args.recipe, [])
    try:
        cfg = build_config(recipe, overrides + args.overrides, args.config_file, args.hf_path, args.seq_length)
    except (ValueError, OverridesError) as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    named = re.search(r"_(\d+)gpu_", recipe)
    try:
        plan = plan_memory(cfg, gpus=args.gpus or (1 if args.published else int(named.group(1)) if named else None),
                           num_microbatches=args.num_microbatches, k=args.k)
    except ValueError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    model, train = cfg.model, cfg.train
    title = (f"{'published case: ' if args.published else ''}{recipe} {' '.join(overrides + args.overrides)}\n"
             f"  {model.num_layers} layers, H={model.hidden_size}, V={model.vocab_size:,}, TP="
             f"{model.tensor_model_parallel_size} CP={model.context_parallel_size} PP="
             f"{model.pipeline_model_parallel_size}, recompute={model.recompute_granularity}\n"
             f"  planned: seq_length={model.seq_length:,}, micro_batch_size={train.micro_batch_size} "
             f"(one microbatch in flight: {model.seq_length * train.micro_batch_size:,} tokens), global_batch_size="
             f"{train.global_batch_size}")
    print(format_plan(plan, args.gpu_memory, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
