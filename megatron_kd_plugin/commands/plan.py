"""What a KD run needs per GPU, by component, and whether it fits: ``python -m megatron_kd_plugin plan``.

    python -m megatron_kd_plugin plan --recipe qwen3_8b_to_0p6b_kd_1m_1gpu_h200_bf16_config [overrides] \\
        [--hf-path STUDENT] [--gpu-memory 140]
    python -m megatron_kd_plugin plan --published [--hf-path QWEN3_1P7B]   # gpt-oss vocabulary, 32K x 4 tokens

The recipes take the student's architecture from its HF checkpoint (``--hf-path``: a folder, of which only
config.json is read, or a hub id, fetched like the train command fetches it).

Model state and activations come from Megatron-Bridge's own estimator
(``megatron.bridge.training.utils.theoretical_memory_utils.estimate_training_memory``: parameters on the most
loaded shard, 18 B/parameter of Adam state or 6 B + 12 B sharded with the distributed optimizer; activations by
Korthikanti et al.'s Table 2 with selective recompute and sequence parallelism, divided by TP and CP). This module
only splits that estimate into weights / gradients / optimizer, applies the recipe's recompute setting, and
replaces the estimator's output-layer term (it assumes full fp32 logits) by the loss head of each formulation,
for the T = s·b/cp tokens one rank's loss sees (V_p = padded V / tp, K teacher ids, c = the chunk budget):

  fused            c + T·H·4 (dX) + V_p·H·4 (dW, fp32 like main_grad) + 8·T·K·4 (per-token state)
  forward_chunked  2·T·V_p·4 (logits + their gradient) + dX + dW + 8·T·K·4
  megatron_peer    T·V_p·3·4 (fp32 logits, exp, log-probs; fp32 measured: 12.0 B/logit) + with a = 2 B activations
                   T·V_p·2·2 (the output layer's bf16 logits and their gradient) + T·H·a; dW goes to main_grad
  dense            5·T·V·4 (the plugin's reference: logits, log q, the [T, V] teacher grid, gradients; measured
                   20.8 B/logit) + dX + dW

plus the KD batch itself (T·K·(4 + 4): teacher ids and log-probs). Recompute: ``selective`` (and None, with the
flash attention of Transformer Engine: no [s, s] scores are kept) use Bridge's per-layer figure;
``full`` keeps one 2-byte [s/cp, b, H/tp] input per checkpointed group plus the recomputed group's own
activations. A GPU "fits" when the total is at most 90% of its memory (the CUDA context, the allocator's
fragmentation and kernel workspaces take the rest).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys

GIB = 2**30
USABLE_FRACTION = 0.9
"""Share of a GPU's memory a plan may fill."""
DEFAULT_K = 64
"""Teacher ids per token when the config does not say (``dataset.k`` is None: read from the store)."""
LOSS_HEADS = ("fused", "forward_chunked", "megatron_peer", "dense")
PUBLISHED_CASE = ("qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config",   # planned on one GPU
                  ["model.vocab_size=201088", "model.seq_length=32768", "dataset.seq_length=32768",
                   "train.micro_batch_size=4", "model.context_parallel_size=1", "model.tensor_model_parallel_size=1",
                   "model.recompute_granularity=full", "model.recompute_method=uniform",
                   "model.recompute_num_layers=1"])
"""The published headline's shape (gpt-oss-120b's vocabulary 201,088; 32K x 4 tokens a microbatch) on one GPU, for a
Qwen3-1.7B student with full recompute."""


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
        "dense": 5 * t * v * 4 + dx + dw,
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
    """Everything the backward keeps of one microbatch's forward, without the loss head."""
    kd_batch: float
    """The microbatch's teacher ids and log-probs on this rank."""
    loss_head: dict[str, float]
    """Peak of each loss formulation above the model."""
    impl: str
    """The recipe's ``kd.impl``."""
    chunk_bytes: int
    """The fused loss's chunk budget c the plan used."""
    notes: tuple[str, ...]
    """Bridge's estimator assumptions plus this plan's."""

    def total(self, impl: str | None = None) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.kd_batch
                + self.loss_head[impl or self.impl])


def _activation_bytes(cfg) -> int:
    mixed = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else ""
    return 2 if cfg.model.bf16 or cfg.model.fp16 or "bf16" in mixed or "fp16" in mixed else 4


def _padded_vocab(model) -> int:
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    if not model.should_pad_vocab:
        return model.vocab_size
    return calculate_padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                                       model.tensor_model_parallel_size, logging_enabled=False)


def _activations_without_output_layer(cfg, bridge_activation: float, activation_bytes: int) -> float:
    """Bridge's activation estimate without its output-layer term, under the recipe's recompute setting."""
    model, mbs = cfg.model, cfg.train.micro_batch_size
    s, h, layers = model.seq_length, model.hidden_size, model.num_layers
    tp, cp, pp = model.tensor_model_parallel_size, model.context_parallel_size, model.pipeline_model_parallel_size
    split = tp * cp
    if pp == 1:   # the estimator's "inputs to output layer and CE loss" term (full logits), as it writes it
        bridge_activation -= s * mbs * h * 4 * (1 + _padded_vocab(model) / h) / split
    embedding = (8 * s * mbs + s * mbs * h) * pp / split                  # its embedding terms
    per_layer = (bridge_activation - embedding) / layers * activation_bytes / 2
    if model.recompute_granularity != "full":
        return embedding + layers * per_layer
    group = model.recompute_num_layers or 1
    layer_input = 2 * s * mbs * h / split                                    # one checkpointed bf16 input
    if model.recompute_method == "block":                                   # the first `group` layers recompute
        return embedding + group * layer_input + (layers - group) * per_layer + per_layer
    return embedding + -(-layers // group) * layer_input + group * per_layer


def plan_memory(cfg, *, gpus: int | None = None, num_microbatches: int | None = None, k: int | None = None,
                device: str = "cuda", with_optimizer: bool = True, transient_dw: bool = True) -> MemoryPlan:
    """The per-GPU memory of KD run ``cfg`` (a ``KDConfigContainer``) on ``gpus`` GPUs (default: TP·CP·PP, one DP
    rank); ``device`` picks the loss's default chunk budget; ``with_optimizer`` / ``transient_dw`` False describe a
    bare forward + backward (the CPU benchmark)."""
    from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory

    from megatron_kd_plugin.loss.options import DEFAULT_CHUNK_BYTES

    cfg = copy.deepcopy(cfg)
    model = cfg.model
    tp, cp = model.tensor_model_parallel_size, model.context_parallel_size
    model_parallel = tp * cp * model.pipeline_model_parallel_size
    gpus = gpus or model_parallel
    if gpus % model_parallel:
        raise ValueError(f"gpus={gpus} is not a multiple of TP x CP x PP = {model_parallel}")
    cfg.data_parallel_size = gpus // model_parallel   # Bridge sets it at run time from the world size
    estimate = estimate_training_memory(cfg, num_microbatches=num_microbatches)
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
    notes = estimate.assumptions + (
        f"{gpus} GPUs: TP={tp}, CP={cp}, PP={model.pipeline_model_parallel_size}, DP="
        f"{cfg.data_parallel_size}; activations of one microbatch ({cfg.train.micro_batch_size} x "
        f"{model.seq_length} tokens), recompute={model.recompute_granularity}.",
        "The loss head replaces the estimator's output-layer term; PP>1 adds the last stage's loss head to the "
        "first stage's activations (an upper bound).")
    return MemoryPlan(weights=params * a, gradients=params * 4, optimizer=optimizer,
                      activations=_activations_without_output_layer(cfg, estimate.activation.memory_bytes, a),
                      kd_batch=tokens * k * 8, loss_head=loss_head_bytes(shape, transient_dw=transient_dw),
                      impl=cfg.kd.impl, chunk_bytes=shape.chunk_bytes, notes=notes)


def bench_step_predictions(*, hidden: int, vocab: int, heads: int, groups: int, ffn: int, layers: int,
                           seq_length: int, micro_batch: int, k: int, chunk_bytes: int | None = None,
                           ) -> dict[str, float]:
    """The planner's bytes for each ``tools/bench_step.py`` variant at one shape: weights + gradients +
    activations (+ the loss head), fp32, no optimizer, the lm_head's gradient in ``.grad`` (plain autograd).

    ``student_only`` (no loss) keeps no activations for the head. Built on the CPU recipe with the benchmark's
    student (RMSNorm, SwiGLU, GQA, untied embeddings, TP=1, no recompute).
    """
    import torch.nn.functional as F

    from megatron_kd_plugin.recipes.tiny import tiny_gpt_kd_cpu_fp32_config

    cfg = tiny_gpt_kd_cpu_fp32_config()
    for name, value in dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=hidden // heads, ffn_hidden_size=ffn, vocab_size=vocab, seq_length=seq_length,
                            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False).items():
        setattr(cfg.model, name, value)
    cfg.dataset.seq_length, cfg.train.micro_batch_size, cfg.kd.chunk_bytes = seq_length, micro_batch, chunk_bytes
    plan = plan_memory(cfg, k=k, device="cpu", with_optimizer=False, transient_dw=False)
    model = plan.weights + plan.gradients + plan.activations
    predicted = {"student_only": model}
    for variant, impl in (("dense", "dense"), ("megatron_peer", "megatron_peer"), ("forward_chunked",
                          "forward_chunked"), ("fused_recompute", "fused"), ("fused_grad_in_forward", "fused")):
        predicted[variant] = model + plan.loss_head[impl]
    return predicted


def fits(plan: MemoryPlan, gpu_gib: float, impl: str | None = None) -> bool:
    """Whether ``plan`` with loss ``impl`` fits a GPU of ``gpu_gib`` GiB (``USABLE_FRACTION`` of it)."""
    return plan.total(impl) <= USABLE_FRACTION * gpu_gib * GIB


def format_plan(plan: MemoryPlan, gpu_gib: float, title: str) -> str:
    """The plan as a table: one column per loss formulation (the recipe's first), one row per component."""
    impls = [plan.impl] + [i for i in LOSS_HEADS if i != plan.impl]
    shared = [("weights", plan.weights), ("gradients", plan.gradients), ("optimizer states", plan.optimizer),
              ("activations", plan.activations), ("KD batch (teacher ids, log-probs)", plan.kd_batch)]
    width = 36
    lines = [title, f"{'GiB per GPU':<{width}}" + "".join(f"{i:>17}" for i in impls)]
    lines += [f"{name:<{width}}" + f"{value / GIB:>17.2f}" * len(impls) for name, value in shared]
    lines.append(f"{'loss head':<{width}}" + "".join(f"{plan.loss_head[i] / GIB:>17.2f}" for i in impls))
    lines.append(f"{'total':<{width}}" + "".join(f"{plan.total(i) / GIB:>17.2f}" for i in impls))
    verdict = ["fits" if fits(plan, gpu_gib, i) else "does NOT fit" for i in impls]
    lines.append(f"{f'{gpu_gib:g} GiB GPU (90% usable)':<{width}}" + "".join(f"{v:>17}" for v in verdict))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_kd_plugin plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="--recipe, --config-file, --hf-path, --seq-length and the overrides are the "
                                            "train command's: give the plan the arguments of the run it plans")
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
