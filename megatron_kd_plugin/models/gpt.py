"""A megatron-core GPTModel from a small JSON-able spec, saved and loaded across tensor-parallel sizes.

``build_gpt(spec, tp_size=...)`` needs megatron's ``parallel_state`` initialised with that TP size. On CPU it
uses CPU initialisation and megatron's local (non-Transformer-Engine) layers through the decoder BLOCK spec (a
layer spec would give the block a TE final norm when TE is installed), in float32; on a GPU it uses Transformer
Engine layers when TE is importable, in ``params_dtype``.

A checkpoint folder holds ``gpt_spec.json`` and ``model.pt``: every parameter at its TP=1 shape, gathered along
the parameter's ``partition_dim`` (megatron marks each TP-sharded parameter with ``tensor_model_parallel`` and
``partition_dim``) and sliced back at load, so a model saved at TP=1 loads at TP=2 and vice versa. Fused QKV
(query groups are contiguous per rank) slices contiguously; SwiGLU's fc1 ([gate; up] per rank) is gathered per
half. megatron-core's ``dist_checkpointing`` was the first choice but its torch_dist save calls
``torch.cuda.synchronize`` (fails without CUDA); the full-state file is one gather per parameter to rank 0, fine
for teachers that fit one host's memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import pickle
from dataclasses import dataclass

import torch

SPEC_FILE = "gpt_spec.json"
WEIGHTS_FILE = "model.pt"


@dataclass(frozen=True, kw_only=True)
class GPTSpec:
    """The architecture of a GPTModel (everything ``build_gpt`` needs besides the parallel sizes)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Attention heads (a multiple of the TP size)."""
    ffn_hidden_size: int
    """MLP inner width."""
    vocab_size: int
    """Vocabulary size V (a multiple of the TP size: pad it)."""
    seq_length: int
    """Maximum sequence length (RoPE / position-embedding table size)."""
    num_query_groups: int | None = None
    """Grouped-query attention groups (None: multi-head attention)."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm"."""
    activation: str = "gelu"
    """"gelu" or "swiglu" (gated SiLU)."""
    position_embedding_type: str = "rope"
    """"rope" or "learned_absolute"."""
    rotary_base: int = 10000
    """RoPE base."""
    share_embeddings_and_output_weights: bool = False
    """Tie the lm_head to the input embedding."""
    add_bias_linear: bool = True
    """Biases in the linear layers."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization={self.normalization!r}; choose 'LayerNorm' or 'RMSNorm'")
        if self.activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation={self.activation!r}; choose 'gelu' or 'swiglu'")
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r}; choose 'rope' or "
                             "'learned_absolute'")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GPTSpec":
        return cls(**json.loads(text))

    def check_tp(self, tp_size: int) -> None:
        """ValueError unless heads, query groups and vocab split evenly over ``tp_size`` ranks."""
        for name in ("num_attention_heads", "vocab_size", "ffn_hidden_size"):
            if getattr(self, name) % tp_size:
                raise ValueError(f"{name}={getattr(self, name)} is not a multiple of tp_size={tp_size}")
        if self.num_query_groups is not None and self.num_query_groups % tp_size:
            raise ValueError(f"num_query_groups={self.num_query_groups} is not a multiple of tp_size={tp_size}")


def _use_transformer_engine() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(spec: GPTSpec, *, tp_size: int, params_dtype: torch.dtype = torch.float32):
    """The megatron-core TransformerConfig of ``spec`` (dropout 0: a teacher/cached forward is deterministic)."""
    from megatron.core.transformer import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    gated = spec.activation == "swiglu"
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size, num_query_groups=spec.num_query_groups,
        normalization=spec.normalization, gated_linear_unit=gated,
        activation_func=torch.nn.functional.silu if gated else torch.nn.functional.gelu,
        add_bias_linear=spec.add_bias_linear, init_method_std=spec.init_method_std,
        tensor_model_parallel_size=tp_size, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)


def build_gpt(spec: GPTSpec, *, tp_size: int, params_dtype: torch.dtype = torch.float32):
    """A GPTModel of ``spec`` for this rank (``parallel_state`` must be initialised with TP = ``tp_size``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec.check_tp(tp_size)
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("megatron parallel_state is not initialised (initialize_model_parallel first)")
    actual = parallel_state.get_tensor_model_parallel_world_size()
    if actual != tp_size:
        raise ValueError(f"tp_size={tp_size} but parallel_state has tensor_model_parallel_size={actual}")
    if params_dtype != torch.float32 and not torch.cuda.is_available():
        raise ValueError(f"params_dtype={params_dtype} needs a GPU; CPU runs are float32")
    config = transformer_config(spec, tp_size=tp_size, params_dtype=params_dtype)
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=_use_transformer_engine())
    return GPTModel(config=config, transformer_layer_spec=block_spec, vocab_size=spec.vocab_size,
                    max_sequence_length=spec.seq_length, parallel_output=True,
                    share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
                    position_embedding_type=spec.position_embedding_type, rotary_base=spec.rotary_base)


def gpt_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's vocab-parallel logits ``[s, b, V/tp]`` for tokens ``[b, s]`` (causal, positions 0..s-1)."""
    b, s = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    causal_mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1).view(1, 1, s, s)  # True = masked
    return model(tokens, position_ids, causal_mask).transpose(0, 1)                           # [s, b, V/tp]


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _is_gated_fc1(name: str, spec: GPTSpec) -> bool:
    """SwiGLU's fc1 holds [gate; up] per rank, so its TP shards are not contiguous slices of the full tensor."""
    return spec.activation == "swiglu" and ".mlp.linear_fc1." in name


def full_tensor(name: str, param: torch.Tensor, spec: GPTSpec) -> torch.Tensor:
    """The TP=1 tensor of parameter ``param`` (gathered along its ``partition_dim``; call on every TP rank)."""
    import torch.distributed as dist

    local = param.detach().cpu()
    if not getattr(param, "tensor_model_parallel", False):
        return local.clone()
    group = _tp_group()
    tp = dist.get_world_size(group)
    if tp == 1:
        return local.clone()
    shards = [torch.empty_like(param.detach()) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    shards = [shard.cpu() for shard in shards]
    dim = param.partition_dim
    if _is_gated_fc1(name, spec):
        halves = [shard.chunk(2, dim=dim) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def local_slice(name: str, full: torch.Tensor, param: torch.Tensor, spec: GPTSpec) -> torch.Tensor:
    """This TP rank's part of the TP=1 tensor ``full`` of parameter ``param`` (inverse of :func:`full_tensor`)."""
    import torch.distributed as dist

    if not getattr(param, "tensor_model_parallel", False):
        return full
    group = _tp_group()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = param.partition_dim
    if _is_gated_fc1(name, spec):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def save_gpt(model, spec: GPTSpec, path) -> None:
    """Saves ``model`` (call on every rank) and its spec into folder ``path`` (existing files are replaced).

    Every parameter is gathered to its TP=1 shape along its ``partition_dim`` and global rank 0 writes one
    ``model.pt`` of full tensors, so any TP size the spec allows can load it.
    """
    import torch.distributed as dist

    path = pathlib.Path(path)
    full = {name: full_tensor(name, param, spec) for name, param in model.named_parameters()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(full, path / WEIGHTS_FILE)
        (path / SPEC_FILE).write_text(spec.to_json() + "\n")
    if dist.is_initialized():
        dist.barrier()


def load_gpt(path, *, tp_size: int, params_dtype: torch.dtype = torch.float32):
    """(model, spec) from a folder written by :func:`save_gpt`, at any TP size the spec allows.

    Seeds megatron's TP RNG tracker (``seed_model_parallel(0)``) if nobody has: its forward needs it.
    """
    path = pathlib.Path(path)
    if not (path / SPEC_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a save_gpt checkpoint (needs {SPEC_FILE} and {WEIGHTS_FILE})")
    try:
        spec = GPTSpec.from_json((path / SPEC_FILE).read_text())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path / SPEC_FILE} is not a GPTSpec JSON ({exc})") from exc
    from megatron.core import tensor_parallel

    from megatron_kd_plugin.cpu_compat import seed_model_parallel

    try:
        full = torch.load(path / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path / WEIGHTS_FILE} cannot be read ({str(exc).splitlines()[0]}): the file is truncated "
                         "or damaged; save the teacher again") from exc
    if not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        seed_model_parallel(0)   # megatron's forward forks the TP RNG tracker even with dropout 0
    model = build_gpt(spec, tp_size=tp_size, params_dtype=params_dtype)
    params = dict(model.named_parameters())
    if set(full) != set(params):
        raise ValueError(f"{path}: checkpoint parameters do not match the spec's model (missing "
                         f"{sorted(set(params) - set(full))[:5]}, unexpected {sorted(set(full) - set(params))[:5]})")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local_slice(name, full[name], param, spec))
    return model, spec


def checkpoint_identity(path) -> str:
    """``name:sha256=…`` over the checkpoint's files (names and contents): the teacher identity of a cache."""
    path = pathlib.Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return f"{path.resolve().name}:sha256={digest.hexdigest()[:16]}"
