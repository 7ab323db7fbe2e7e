"""The megatron-core work-arounds needed to run on a machine without CUDA — all of them, in one place.

Every work-around is applied only when ``torch.cuda.is_available()`` is False; on a GPU these functions leave
megatron-core untouched, so a GPU run never silently takes a CPU path. What runs on CPU with them: megatron-core's
GPTModel with its local (non-Transformer-Engine) layers, tensor parallelism over gloo, forward and backward;
MoE layers with expert parallelism (allgather dispatcher, router GEMM in torch); pipeline p2p over gloo; the
teachers of the README's families through Megatron-Bridge: sliding-window attention (gpt-oss; the mask megatron
builds itself, and within a given mask: packed rows' documents), multi-latent attention (DeepSeek-V3, Kimi-K2; the local attention takes its head widths), experts
that Bridge maps only onto Transformer Engine's grouped experts (GLM-4.5; ``bridge_local_expert_mappings``).
What does not: Transformer Engine layers, sequence parallelism through TE/apex norms, megatron-core's and
Megatron-Bridge's training schedules (they allocate on "cuda"; see ``megatron_kd_plugin.bridge.cpu_train`` and
``megatron_kd_plugin.cache.teacher_forward``).
"""

from __future__ import annotations

import copy
import functools
import re

import torch

_applied = False
_window_softmax = None
"""megatron-core's local softmax as ``_window_within_mask`` wraps it, once applied."""


def cuda_absent() -> bool:
    """True when this process has no usable CUDA device (the only case any work-around applies)."""
    return not torch.cuda.is_available()


def apply_cpu_workarounds() -> None:
    """Make megatron-core usable on CPU; a no-op with CUDA present, idempotent otherwise."""
    global _applied, _window_softmax
    if _applied or not cuda_absent():
        return
    # megatron allocates buffers with device=torch.cuda.current_device() (~200 places: attention masks, RoPE,
    # the TP gather mappings); on CPU that call raises, so it answers with the CPU device instead.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # the MoE router's gating GEMM goes through Transformer Engine whenever TE imports, and TE asks for CUDA
    # device properties: keep it in torch.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    # the attention masks megatron builds itself when a layer has a sliding window (gpt-oss) or gets no mask are
    # allocated with a literal device="cuda": build them on the CPU (each module holds its own reference)
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    for module in (transformer_utils, fused_softmax):
        for name in ("get_sliding_window_causal_mask", "get_default_causal_mask"):
            setattr(module, name, _cuda_literal_on_cpu(getattr(module, name)))
    # a sliding-window layer's local softmax replaces the mask it is given by its window's: packed rows' documents
    # (documents.document_attention_mask) would see one another within the window
    softmax = fused_softmax.FusedScaleMaskSoftmax
    _window_softmax = softmax.forward_torch_softmax = _window_within_mask(softmax.forward_torch_softmax)
    # multi-latent attention (DeepSeek-V3, Kimi-K2) hands its core attention TE's k_channels / v_channels, which the
    # local DotProductAttention of the non-TE layer specs does not take
    from megatron.core.models import backends

    backends.DotProductAttention = _attention_with_head_widths(backends.DotProductAttention)
    _applied = True


def _attention_with_head_widths(local_attention: type) -> type:
    """megatron-core's local ``DotProductAttention`` that also takes ``k_channels`` / ``v_channels`` (the widths of a
    query/key head and of a value head, which differ under multi-latent attention). Its computation holds for any
    widths; only the output width (heads x value width) and the default scale (1/sqrt(key width)) need them. The class
    keeps its base's name: Megatron-Bridge tells how a module's weights split over TP by its class name (gpt-oss's
    sinks)."""

    class DotProductAttention(local_attention):
        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
            if k_channels is not None and kwargs.get("softmax_scale") is None:
                coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
                self.softmax_scale = 1.0 / (k_channels ** 0.5) / coeff

    return DotProductAttention


def window_keeps_given_mask() -> bool:
    """Whether megatron-core's local softmax on a sliding-window layer masks the mask it is given too (this
    module's ``_window_within_mask`` is in place: only on a machine without CUDA)."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    return _window_softmax is not None and FusedScaleMaskSoftmax.forward_torch_softmax is _window_softmax


def _window_within_mask(forward_torch_softmax):
    """megatron-core's local masked softmax, where a layer with a sliding window masks what its window masks *and*
    what the given mask masks (a packed row's other documents), instead of the window's mask alone."""

    @functools.wraps(forward_torch_softmax)
    def softmax(self, input, mask, softmax_offset=None):
        if self.window_size is None or mask is None:
            return forward_torch_softmax(self, input, mask, softmax_offset)
        from megatron.core.fusions import fused_softmax

        window = fused_softmax.get_sliding_window_causal_mask(input.size(2), input.size(3), self.window_size)
        self.window_size, window_size = None, self.window_size
        try:
            return forward_torch_softmax(self, input, mask | window.to(mask.device), softmax_offset)
        finally:
            self.window_size = window_size

    return softmax


def _cuda_literal_on_cpu(function):
    """``function`` run so that its literal ``device="cuda"`` allocations land on the CPU (megatron's own code, not
    a copy of it)."""

    @functools.wraps(function)
    def on_cpu(*args, **kwargs):
        with _CudaDeviceAsCpu():
            return function(*args, **kwargs)

    return on_cpu


def local_block_spec(config, vp_stage: int | None = None):
    """megatron-core's decoder block spec with local (non-TE) layers: the final norm of a layer spec would be TE's.

    A ``transformer_layer_spec`` for providers (Bridge calls it with ``vp_stage`` under pipeline parallelism).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)


def cpu_model_settings() -> dict:
    """TransformerConfig fields a megatron-core model needs on CPU (empty with CUDA present).

    Local layers (:func:`local_block_spec`), CPU initialisation, every CUDA fusion off; MoE: the allgather
    dispatcher (alltoall builds a ``torch.cuda.Stream``), no grouped GEMM or fused permute (TE/CUDA kernels);
    pipeline p2p without ``torch.cuda.synchronize`` after batched sends.
    """
    if not cuda_absent():
        return {}
    return dict(
        transformer_layer_spec=local_block_spec, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, cross_entropy_loss_fusion=False,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_fusion=False, moe_shared_expert_overlap=False, batch_p2p_sync=False)


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's tensor-parallel RNG tracker (call after ``initialize_model_parallel``).

    On CPU the default tracker calls ``torch.cuda.get_rng_state``; the inference tracker does not, and
    ``force_reset_rng`` lets tests re-seed within one process.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if cuda_absent():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class _CudaDeviceAsCpu(torch.overrides.TorchFunctionMode):
    """Inside: a literal ``device="cuda"`` allocates on the CPU, ``t.cuda()`` is ``t``, and ``t.type()`` names the
    CUDA type (``torch.cuda.FloatTensor``): what megatron-core's optimizers assume of their parameters."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _NoStream:
    """``torch.cuda.current_stream()`` without CUDA: DDP's gradient sync only waits on it for CUDA-graph events."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def megatron_optimizer_on_cpu():
    """A context in which megatron-core's DDP buffers and optimizers (``get_megatron_optimizer``, the distributed
    optimizer) can be built and stepped on CPU; a no-op context with CUDA present.

    Work-arounds (besides ``apply_cpu_workarounds``, which it applies): megatron's optimizer factory and gradient
    clipping pick Transformer Engine's fused Adam and multi-tensor kernels whenever TE imports (CUDA-only): they are
    pointed at torch's AdamW and megatron-core's own local multi-tensor functions; DDP's gradient sync asks for
    ``torch.cuda.current_stream()``; the optimizers allocate scalars with a literal ``device="cuda"`` and check
    ``param.type() == "torch.cuda.FloatTensor"`` (the context maps both, see ``_CudaDeviceAsCpu``).
    """
    import contextlib

    if not cuda_absent():
        return contextlib.nullcontext()
    apply_cpu_workarounds()
    import megatron.core.optimizer as optimizer_factory
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizers
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm, local_multi_tensor_scale

    optimizer_factory.USING_PYTORCH_OPTIMIZER, optimizer_factory.Adam = True, torch.optim.AdamW
    clip_grads.multi_tensor_applier = optimizers.multi_tensor_applier = local_multi_tensor_applier
    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = optimizers.multi_tensor_scale_impl = local_multi_tensor_scale
    clip_grads.multi_tensor_scale_tensor_impl = None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    return _CudaDeviceAsCpu()


def dist_checkpointing_on_cpu() -> None:
    """Let megatron-core's dist_checkpointing save synchronously on CPU (a no-op with CUDA present).

    Its torch_dist writer calls ``torch.cuda.synchronize()`` before copying tensors out (nothing to wait for
    without CUDA), and collects the write results in a queue of a spawned ``multiprocessing.Manager``, which a
    daemonic process (a test rank) cannot start and which costs a fresh interpreter per save: a synchronous save
    writes from threads of this process, so a plain in-process queue serves.
    """
    if not cuda_absent():
        return
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda device=None: None
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def hf_export_without_modelopt() -> None:
    """Let AutoBridge's HF export run on a CPU machine without ModelOpt (a no-op with CUDA present or ModelOpt
    installed): ``save_hf_weights`` imports ModelOpt only to ask whether the model is quantized, and a model on
    a machine without ModelOpt cannot be, so a stand-in module answers False. (ModelOpt does not install here; a
    CUDA machine gets it from the ``[gpu]`` extra.)"""
    import importlib.util
    import sys
    import types

    if not cuda_absent() or "modelopt" in sys.modules or importlib.util.find_spec("modelopt") is not None:
        return
    names = ("modelopt", "modelopt.torch", "modelopt.torch.quantization", "modelopt.torch.quantization.utils")
    modules = {name: types.ModuleType(name) for name in names}
    for parent, child in zip(names, names[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    modules[names[-1]].is_quantized = lambda model: False
    sys.modules.update(modules)


_GROUPED_EXPERT = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<linear>linear_fc[12])\.(?P<kind>weight|bias)\*$")


def bridge_local_expert_mappings() -> None:
    """Let Megatron-Bridge load MoE experts into megatron-core's local experts on CPU (a no-op with CUDA present).

    Without Transformer Engine the experts are ``SequentialMLP``s, named ``...mlp.experts.local_experts.N.linear_fcK``;
    some of Bridge 0.6.2's mapping registries (GLM-4.5's) name only TE's grouped experts,
    ``...mlp.experts.linear_fcK.weightN``, so their experts would not load. Every registry gets, for each grouped
    expert mapping without a local twin, the same mapping under the local name (same class, same HF tensor; Bridge
    reads the expert number from either name)."""
    if not cuda_absent():
        return
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    original = MegatronMappingRegistry.__init__
    if getattr(original, "adds_local_experts", False):
        return

    @functools.wraps(original)
    def with_local_experts(self, *mappings):
        original(self, *mappings, *_local_expert_twins(mappings))

    with_local_experts.adds_local_experts = True
    MegatronMappingRegistry.__init__ = with_local_experts


def _local_expert_twins(mappings) -> list:
    """Copies of the grouped-expert mappings under megatron-core's local-expert names, where none exists."""
    named = {mapping.megatron_param for mapping in mappings}
    twins = []
    for mapping in mappings:
        match = _GROUPED_EXPERT.match(mapping.megatron_param)
        if match is None:
            continue
        local = f"{match['experts']}.local_experts.*.{match['linear']}.{match['kind']}"
        if local in named:
            continue
        twin = copy.copy(mapping)
        twin.megatron_param = local
        twin._broadcast_obj_cache, twin._tensor_spec_output_cache = {}, {}
        twins.append(twin)
    return twins
