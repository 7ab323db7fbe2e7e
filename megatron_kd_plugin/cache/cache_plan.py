"""Memory per GPU of a teacher-cache layout (``python -m megatron_kd_plugin plan --cache``): what ``python -m
megatron_kd_plugin cache`` holds on its most loaded rank at the given settings, from the teacher's config.json alone.

One micro-batch of b = ``--micro-batch-size`` windows of s = ``--seq-length`` tokens; T = s·b/cp tokens reach a rank
(CP slices each window). a = bytes of the teacher's dtype (bf16 2, fp32 4), H the width, Hq = heads·head_dim,
G = query groups·head_dim, F the MLP width (MoE: top-k · expert width, the tokens a rank's experts see on average),
all of Hq, G, F divided by TP (F by expert TP for MoE); V_p = padded V / TP, K the store's slots per token, P samples
per shard::

  weights       params on the most loaded rank (Megatron-Bridge's ``estimate_training_memory``, the counter the
                training ``plan`` uses) · a
  forward       one layer's working set (no backward: nothing is kept between layers), the larger of
                  attention  T·a·(2H + Hq + 2G + 2·(Hq + G) + Hq)   input, normalised input, the QKV projection's
                             output [T, Hq + 2G], Q and K after their norm and after RoPE, the core's output;
                             with ``attention="local"`` (megatron-core's DotProductAttention, the CPU path) also
                             2·b·(heads/TP)·s²·a: its scores and probabilities [b, heads, s, s]. Flash / TE attention
                             keep no [s, s] (``attention="flash"``)
                  MLP        T·a·(3H + 4F)   input, the attention's residual sum, normalised input; fc1's 2F, the
                             SiLU's F and the gate product's F (SwiGLU; GeLU: 2F)
                plus the layer's output [T, H]·a that replaces its input
  head          the fused head (``teacher_head.py``) after the last layer: the final hidden states [T, H]·a and one
                block of p·n token rows of V_p·(a + w) bytes (w: the store kind's ``work_bytes_per_logit``), p·n
                from ``teacher_head.block_shape`` under ``--head-chunk-bytes``; plus the micro-batch's rows
                [s, b, K] (int64 ids and fp32 log-probs, 12 B a slot) gathered over CP
  shard buffer  host memory, the arrays of one shard before they are written (``writer.compute_shard``): the windows
                read [P, S+1] int64 and their int32 copy, and every per-sample array of the store in its stored
                dtype (ids [P, S, K] int32, log-probs [P, S, K] of the codec, per-token arrays [P, S])
  total (GPU)   weights + max(forward, head)            (the shard buffer lives in host memory)
  total (CPU)   weights + max(forward, head) + shard buffer   (what ``tools/bench_cache_plan.py`` measures)

A GPU fits the layout when its total is at most ``USABLE_FRACTION`` of ``--gpu-memory`` (the CUDA context, NCCL
buffers and the allocator's fragmentation take the rest). Not planned: pipeline stages' p2p buffers (one [s, H]
activation a sample), MoE dispatch buffers beyond the formula's (the allgather dispatcher gathers the EP group's
tokens: T·EP·H·a more on a MoE layer), Transformer Engine's workspaces.
"""

from __future__ import annotations

import dataclasses
import types

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.teacher_context_parallel import check_cp_seq_length
from megatron_kd_plugin.cache.teacher_head import DEFAULT_CHUNK_BYTES, block_shape, row_bytes

GIB = 2**30
USABLE_FRACTION = 0.9
"""Share of a GPU's memory a layout may fill (as the training ``plan``)."""
ATTENTIONS = ("flash", "local")
ROW_SLOT_BYTES = 12
"""Bytes of one slot of a micro-batch's rows on the device: an int64 id and an fp32 log-prob."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherShape:
    """What the cache's memory depends on in the teacher (from its Megatron-Bridge provider)."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    groups: int
    ffn: int
    """F of one layer's MLP as a token sees it (MoE: top-k · the expert width)."""
    gated: bool
    vocab_padded: int
    """Rows of the output layer over all TP ranks."""
    moe: bool
    params_per_gpu: float
    """Parameters on the most loaded rank (Bridge's estimator)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheLayout:
    """The cache command's settings that decide its memory."""

    seq_length: int
    micro_batch_size: int = 1
    tp: int = 1
    cp: int = 1
    etp: int = 1
    spec: fmt.CacheSpec
    """The store (``num_samples`` = the shard's P samples, ``samples_per_shard`` = P)."""
    param_bytes: int = 2
    """a: bytes of the teacher's dtype."""
    head_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    attention: str = "flash"

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTIONS}")
        if self.cp > 1 and self.attention == "local":
            raise ValueError(f"--cp={self.cp} with local attention: megatron-core's local attention has no context "
                             "parallelism (Transformer Engine's has)")
        check_cp_seq_length(self.seq_length, self.cp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachePlan:
    """Bytes per rank of one layout, by component (module docstring)."""

    weights: float
    attention: float
    mlp: float
    head_block: int
    """One block of the fused head: p·n token rows."""
    head: float
    """The head phase: final hidden states + ``head_block`` + the micro-batch's rows."""
    shard_buffer: int
    block: tuple[int, int]
    """(p positions, n samples) of a head block."""

    @property
    def forward(self) -> float:
        return max(self.attention, self.mlp)

    @property
    def gpu_total(self) -> float:
        return self.weights + max(self.forward, self.head)

    @property
    def cpu_total(self) -> float:
        return self.gpu_total + self.shard_buffer


def teacher_shape(provider) -> TeacherShape:
    """The :class:`TeacherShape` of a finalized ``GPTModelProvider`` at its parallel sizes (weights counted by
    ``models.hf.estimate_model_state``: Megatron-Bridge's estimator, optimizer-free, every gated MLP with three
    projections)."""
    from megatron_kd_plugin.models.hf import estimate_model_state, padded_vocab_size

    estimate = estimate_model_state(
        types.SimpleNamespace(model=provider, optimizer=types.SimpleNamespace(use_distributed_optimizer=False),
                              data_parallel_size=1), include_activation=False)
    heads = provider.num_attention_heads
    moe = bool(getattr(provider, "num_moe_experts", None))
    ffn = provider.moe_router_topk * provider.moe_ffn_hidden_size if moe else provider.ffn_hidden_size
    return TeacherShape(layers=provider.num_layers, hidden=provider.hidden_size, heads=heads,
                        head_dim=provider.kv_channels or provider.hidden_size // heads,
                        groups=provider.num_query_groups or heads, ffn=ffn, gated=bool(provider.gated_linear_unit),
                        vocab_padded=padded_vocab_size(provider), moe=moe,
                        params_per_gpu=sum(c.parameter_count_per_gpu for c in estimate.model_state_components))


def head_block_bytes(layout: CacheLayout, vocab_local: int) -> tuple[int, tuple[int, int]]:
    """(bytes, (p, n)) of one fused-head block of a rank's s/cp × b tokens; ValueError naming
    ``--head-chunk-bytes`` when one token row does not fit it."""
    row = row_bytes(vocab_local, layout.param_bytes, layout.spec.kind.work_bytes_per_logit)
    try:
        p, n = block_shape((layout.seq_length // layout.cp, layout.micro_batch_size), row, layout.head_chunk_bytes)
    except ValueError as exc:
        raise ValueError(f"--head-chunk-bytes={layout.head_chunk_bytes}: {exc}".replace(
            f"chunk_bytes={layout.head_chunk_bytes} is ", "")) from None
    return p * n * row, (p, n)


def shard_buffer_bytes(spec: fmt.CacheSpec) -> int:
    """Bytes of one shard's arrays before they are written: the windows ``[P, S+1]`` as read (int64) and as stored
    (int32) and every other per-sample array of the store at its stored shape and dtype (``format.sample_arrays``),
    the records excepted."""
    import numpy as np

    p, s = spec.samples_per_shard, spec.seq_length
    documents = fmt._expected_documents(spec, spec.format_version)          # the zarr.json of each array
    total = p * (s + 1) * 8
    for name in fmt.sample_arrays(spec):
        if name == fmt.RECORDS:
            continue
        shape, dtype = documents[name]["shape"], np.dtype(documents[name]["data_type"])
        total += p * int(np.prod(shape[1:])) * dtype.itemsize
    return total


def plan_cache(teacher: TeacherShape, layout: CacheLayout) -> CachePlan:
    """The :class:`CachePlan` of ``layout`` for ``teacher`` (module docstring's formulas)."""
    a, tp = layout.param_bytes, layout.tp
    s, b = layout.seq_length, layout.micro_batch_size
    tokens = s * b // layout.cp
    h, q, g = teacher.hidden, teacher.heads * teacher.head_dim / tp, teacher.groups * teacher.head_dim / tp
    f = teacher.ffn / (layout.etp if teacher.moe else tp)
    attention = tokens * a * (3 * h + 4 * q + 4 * g)
    if layout.attention == "local":
        attention += 2 * b * teacher.heads / tp * s * s * a
    mlp = tokens * a * (4 * h + (4 if teacher.gated else 2) * f)
    block, shape = head_block_bytes(layout, teacher.vocab_padded // tp)
    head = tokens * h * a + block + s * b * layout.spec.k * ROW_SLOT_BYTES
    return CachePlan(weights=teacher.params_per_gpu * a, attention=attention, mlp=mlp, head_block=block, head=head,
                     shard_buffer=shard_buffer_bytes(layout.spec), block=shape)


def format_cache_plan(plan: CachePlan, gpu_gib: float, title: str) -> str:
    """The plan as a table of GiB per GPU (the most loaded rank), the verdict against ``gpu_gib``."""
    rows = [("weights", plan.weights), ("forward: attention of one layer", plan.attention),
            ("forward: MLP of one layer", plan.mlp),
            (f"fused head: one block ({plan.block[0]} positions x {plan.block[1]} samples)", plan.head_block),
            ("fused head phase (hidden states + block + rows)", plan.head),
            ("total per GPU: weights + max(forward, head)", plan.gpu_total),
            ("writer's shard buffer (host memory)", plan.shard_buffer)]
    width = 58
    lines = [title] + [f"  {name:<{width}}{value / GIB:>10.2f} GiB" for name, value in rows]
    usable = USABLE_FRACTION * gpu_gib * GIB
    verdict = "fits" if plan.gpu_total <= usable else "does NOT fit"
    lines.append(f"  {f'{gpu_gib:g} GiB GPU (90% usable)':<{width}}{verdict:>14} "
                 f"({(usable - plan.gpu_total) / GIB:+.1f} GiB margin)")
    return "\n".join(lines)
