"""Hugging Face checkpoints as megatron-core models, through Megatron-Bridge's ``AutoBridge`` — teachers and students.

    provider = hf_model_provider("Qwen3-8B/", tensor_parallel=8)             # checked, finalized
    initialize_model_parallel(tensor_model_parallel_size=8, ...)              # megatron parallel_state
    chunks = build_model(provider)                                            # [GPTModel] of this rank's stage

A folder is a checkpoint as ``save_pretrained`` writes it: ``config.json`` plus ``*.safetensors`` (one file or an
index of shards). Any architecture Bridge converts works (Qwen3, Llama, gpt-oss, Qwen3-MoE, ...). What the folder
and the requested parallel sizes allow is checked from ``config.json`` before anything is built, with one line
naming the offending value. Without CUDA the provider gets ``cpu_compat.cpu_model_settings()`` (local layers,
fusions off, CPU initialisation, allgather MoE dispatcher, no grouped GEMM) and must be float32.

Vocabulary: under TP the provider pads it as Megatron training does (``make_vocab_size_divisible_by`` × TP, the
padded rows' weights are zeros); ``provider.vocab_size`` stays the checkpoint's true size, :func:`padded_vocab_size` is
what the output layer holds. Rows at and above the true size are not the model's: callers mask them.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import torch

CONFIG_FILE = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"


def is_hf_checkpoint(folder) -> bool:
    """True when ``folder`` holds a Hugging Face ``config.json`` (it may still lack weights: see below)."""
    return (pathlib.Path(folder) / CONFIG_FILE).is_file()


def weight_files(folder) -> list[pathlib.Path]:
    """The safetensors files of the checkpoint (sorted); ValueError when there are none."""
    folder = pathlib.Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weights next to {CONFIG_FILE} (a Hugging Face checkpoint "
                         "as save_pretrained(..., safe_serialization=True) writes it is needed)")
    return files


def read_hf_config(folder) -> dict:
    """``config.json`` of the checkpoint at ``folder`` as a dict (text config of a multimodal one merged in)."""
    path = pathlib.Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{folder}: no {CONFIG_FILE}; not a Hugging Face checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return {**config.get("text_config", {}), **config}


def architecture(config: dict) -> str:
    """The checkpoint's architecture name (``config.json``'s first ``architectures`` entry)."""
    names = config.get("architectures") or []
    if not names:
        raise ValueError(f"{CONFIG_FILE} names no 'architectures': cannot tell which model it is")
    return names[0]


def check_parallel_sizes(config: dict, *, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int,
                         expert_tensor_parallel: int | None = None) -> None:
    """ValueError (one line) unless the model in ``config`` splits over the requested parallel sizes
    (``expert_tensor_parallel`` None: the model's choice, see :func:`expert_tensor_parallel_size`)."""
    for name, size in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel),
                       ("expert_parallel", expert_parallel), ("expert_tensor_parallel", expert_tensor_parallel)):
        if size is not None and size < 1:
            raise ValueError(f"{name}={size}: expected >= 1")
    heads = config.get("num_attention_heads")
    groups = config.get("num_key_value_heads") or heads
    if heads and heads % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the {heads} attention heads")
    if groups and groups % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the {groups} key/value heads")
    layers = config.get("num_hidden_layers")
    if layers and pipeline_parallel > layers:
        raise ValueError(f"pipeline_parallel={pipeline_parallel} exceeds the model's {layers} layers")
    experts = next((config[key] for key in ("num_experts", "num_local_experts", "n_routed_experts")
                    if config.get(key)), None)
    for name, size in (("expert_parallel", expert_parallel), ("expert_tensor_parallel", expert_tensor_parallel)):
        if size is not None and size > 1 and experts is None:
            raise ValueError(f"{name}={size} but the model has no experts (not a MoE model)")
    if experts is not None and experts % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} does not divide the model's {experts} experts")


def pipeline_split(layers: int, pipeline_parallel: int) -> tuple[int, int] | None:
    """(layers of the first stage, of the last stage) when ``pipeline_parallel`` does not divide ``layers``, else
    None. The middle stages get ``layers // pipeline_parallel`` each (megatron needs them equal); the first and
    last share the rest, the last (which also holds the output layer and the logits) the smaller half."""
    if layers % pipeline_parallel == 0:
        return None
    middle = layers // pipeline_parallel
    ends = layers - middle * (pipeline_parallel - 2)
    return (ends + 1) // 2, ends // 2


def _auto_bridge(folder, dtype: torch.dtype):
    """``AutoBridge`` of the folder; an architecture Bridge does not convert gets one line naming it."""
    import megatron.bridge
    from megatron.bridge import AutoBridge

    from megatron_kd_plugin.cpu_compat import bridge_local_expert_mappings

    bridge_local_expert_mappings()
    if not AutoBridge.can_handle(str(folder)):
        name = architecture(read_hf_config(folder))
        raise ValueError(f"{folder}: architecture {name} is not one Megatron-Bridge {megatron.bridge.__version__} "
                         f"converts (it converts {len(AutoBridge.list_supported_models())} architectures: "
                         "AutoBridge.list_supported_models())")
    return AutoBridge.from_hf_pretrained(str(folder), dtype=dtype)


def hf_model_provider(folder, *, tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                      expert_tensor_parallel: int | None = None, load_weights: bool = True,
                      dtype: torch.dtype = torch.float32, inference: bool = False):
    """A finalized ``GPTModelProvider`` of the HF checkpoint at ``folder`` for the given parallel sizes.

    ``load_weights``: the checkpoint's weights are loaded when the model is built (else random init).
    ``dtype``: parameter dtype (float32 only without CUDA). ``inference``: dropout off, and for MoE models no
    token dropping (no capacity factor), no load-balancing/z losses, MTP heads not built — a teacher's forward.
    ``expert_tensor_parallel`` (MoE models): the experts' own TP size; None picks what the model supports
    (:func:`expert_tensor_parallel_size`); megatron's ``parallel_state`` must then be built with the provider's
    ``expert_tensor_parallel_size``. A ``pipeline_parallel`` that does not divide the layers gets megatron's uneven
    first/last stages (:func:`pipeline_split`). Raises ValueError (one line) for a folder without config or weights,
    an architecture Bridge does not convert, and sizes the model cannot split over (megatron-core's own refusals
    included); nothing heavy is loaded before these checks (the weights load when the model is built).
    """
    from megatron_kd_plugin.cpu_compat import cpu_model_settings, cuda_absent

    folder = pathlib.Path(folder)
    config = read_hf_config(folder)
    architecture(config)
    if load_weights:
        weight_files(folder)
    check_parallel_sizes(config, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                         expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel)
    if dtype != torch.float32 and cuda_absent():
        raise ValueError(f"dtype={dtype}: without CUDA the model runs in torch.float32")
    provider = _auto_bridge(folder, dtype).to_megatron_provider(load_weights=load_weights)
    provider.tensor_model_parallel_size = tensor_parallel
    provider.pipeline_model_parallel_size = pipeline_parallel
    provider.expert_model_parallel_size = expert_parallel
    provider.expert_tensor_parallel_size = expert_tensor_parallel_size(provider, expert_tensor_parallel)
    split = pipeline_split(provider.num_layers, pipeline_parallel)
    if split is not None:
        provider.num_layers_in_first_pipeline_stage, provider.num_layers_in_last_pipeline_stage = split
    # padded as Megatron training pads it, for TP; at TP=1 there is nothing to split, and Bridge 0.6.2 loads the
    # embedding at TP=1 without padding it (a vocabulary that is no multiple of make_vocab_size_divisible_by, e.g.
    # DeepSeek-V3's 1280 at a tiny size, fails with a shape mismatch)
    provider.should_pad_vocab = tensor_parallel > 1
    provider.params_dtype = provider.pipeline_dtype = dtype
    provider.bf16, provider.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    if inference:
        set_inference_mode(provider)
    for name, value in cpu_model_settings().items():
        setattr(provider, name, value)
    try:
        provider.finalize()
    except AssertionError as exc:           # megatron-core asserts what it cannot build: one line, not a traceback
        first = (str(exc).strip().splitlines() or ["(no message)"])[0]
        raise ValueError(f"{folder}: megatron-core refuses this model at tensor_parallel={tensor_parallel}, "
                         f"pipeline_parallel={pipeline_parallel}, expert_parallel={expert_parallel}, "
                         f"expert_tensor_parallel={provider.expert_tensor_parallel_size}: {first}") from None
    return provider


def expert_tensor_parallel_size(provider, requested: int | None) -> int:
    """The experts' tensor-parallel size for the (not yet finalized) ``provider``, whose ``tensor_model_parallel_size``
    is set: ``requested``, checked, or what the model supports: 1 when its experts have biases (gpt-oss: megatron-core
    supports MoE biases only at expert TP 1), else megatron-core's default, the attention's TP. A dense model: TP
    (megatron's default; no layer uses it). ValueError (one line) for a size the model cannot take."""
    tensor_parallel = provider.tensor_model_parallel_size
    if not getattr(provider, "num_moe_experts", None):
        return tensor_parallel
    biased = bool(provider.add_bias_linear)
    if requested is None:
        return 1 if biased else tensor_parallel
    if biased and requested != 1:
        raise ValueError(f"expert_tensor_parallel={requested}: the model's experts have biases, which megatron-core "
                         "supports only at expert_tensor_parallel=1")
    width = provider.moe_ffn_hidden_size or provider.ffn_hidden_size
    if width % requested:
        raise ValueError(f"expert_tensor_parallel={requested} does not divide the experts' FFN width {width}")
    return requested


def check_expert_parallel(model, world: int | None = None) -> None:
    """ValueError (one line) unless megatron-core can build ``model`` (a provider, e.g. a recipe's ``cfg.model``
    after overrides) at its expert sizes: :func:`expert_tensor_parallel_size`'s rules, and with ``world`` (the
    run's ranks or GPUs) the experts' grid, expert TP x EP x PP, dividing it. A dense model passes."""
    if not getattr(model, "num_moe_experts", None):
        return
    etp = expert_tensor_parallel_size(model, model.expert_tensor_parallel_size or model.tensor_model_parallel_size)
    grid = etp * model.expert_model_parallel_size * model.pipeline_model_parallel_size
    if world is not None and world % grid:
        raise ValueError(f"model.expert_tensor_parallel_size={etp} x model.expert_model_parallel_size="
                         f"{model.expert_model_parallel_size} x model.pipeline_model_parallel_size="
                         f"{model.pipeline_model_parallel_size} = {grid} does not divide the world size {world} "
                         "(megatron-core's experts' grid)")


def set_inference_mode(provider) -> None:
    """A forward as in inference: no dropout; MoE routes every token (no capacity, no aux/z loss); no MTP."""
    provider.hidden_dropout = provider.attention_dropout = 0.0
    provider.mtp_num_layers = None
    if getattr(provider, "num_moe_experts", None):
        provider.moe_expert_capacity_factor = None
        provider.moe_pad_expert_input_to_capacity = False
        provider.moe_router_load_balancing_type = "none"
        provider.moe_aux_loss_coeff = 0.0
        provider.moe_z_loss_coeff = None
        provider.moe_input_jitter_eps = None


def estimate_model_state(cfg, **kwargs):
    """Megatron-Bridge's ``estimate_training_memory(cfg, **kwargs)`` with every gated MLP counted with its three
    projections. Bridge 0.6.2 counts three only when the gated unit's activation is SiLU
    (``_ffn_projection_factor``), but fc1 of any gated unit makes 2F (gpt-oss's clamped gated activation: its
    114.7 B expert parameters were counted as 76.4 B); ``cfg`` is left as it is."""
    import copy

    import torch.nn.functional as F
    from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory

    if cfg.model.gated_linear_unit and cfg.model.activation_func is not F.silu:
        cfg = copy.copy(cfg)
        cfg.model = copy.copy(cfg.model)
        cfg.model.activation_func = F.silu
    return estimate_training_memory(cfg, **kwargs)


def padded_vocab_size(provider) -> int:
    """Rows of the output layer (all TP ranks together): the true vocab padded as Megatron pads it."""
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    if not provider.should_pad_vocab:
        return provider.vocab_size
    return calculate_padded_vocab_size(provider.vocab_size, provider.make_vocab_size_divisible_by,
                                       provider.tensor_model_parallel_size, logging_enabled=False)


def build_model(provider) -> list:
    """This rank's model chunks (``[GPTModel]`` of its pipeline stage; not DDP-wrapped) from ``provider``.

    megatron's ``parallel_state`` must be initialised with the provider's sizes. Seeds megatron's TP RNG tracker
    (``seed_model_parallel(0)``) if nobody has: the forward forks it even without dropout.
    """
    from megatron.core import tensor_parallel

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, cuda_absent, seed_model_parallel

    apply_cpu_workarounds()
    if not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        seed_model_parallel(0)
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=cuda_absent())


def hf_identity(folder) -> str:
    """``ARCH:NAME:sha256=…`` of a HF checkpoint: config.json, the weights index and each safetensors file's
    header, size and first/last MiB of data (cheap for 100+ GB checkpoints, different for different weights)."""
    folder = pathlib.Path(folder)
    digest = hashlib.sha256()
    for path in [folder / CONFIG_FILE, folder / WEIGHTS_INDEX]:
        if path.is_file():
            digest.update(path.read_bytes())
    for path in weight_files(folder):
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f"{path.name}:{size}".encode() + f.read(min(header, size)))
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    config = read_hf_config(folder)
    name = config.get("_name_or_path") or folder.resolve().name
    return f"{architecture(config)}:{name}:sha256={digest.hexdigest()[:16]}"
