"""The megatron-core work-arounds needed to run on a machine without CUDA — all of them, in one place.

Every work-around is applied only when ``torch.cuda.is_available()`` is False; on a GPU these functions leave
megatron-core untouched, so a GPU run never silently takes a CPU path. What runs on CPU with them: megatron-core's
GPTModel with its local (non-Transformer-Engine) layers, tensor parallelism over gloo, forward and backward;
MoE layers with expert parallelism (allgather dispatcher, router GEMM in torch); pipeline p2p over gloo.
What does not: Transformer Engine layers, sequence parallelism through TE/apex norms, megatron-core's and
Megatron-Bridge's training schedules (they allocate on "cuda"; see ``megatron_kd_plugin.bridge.cpu_train`` and
``megatron_kd_plugin.cache.teacher_forward``).
"""

from __future__ import annotations

import torch

_applied = False


def cuda_absent() -> bool:
    """True when this process has no usable CUDA device (the only case any work-around applies)."""
    return not torch.cuda.is_available()


def apply_cpu_workarounds() -> None:
    """Make megatron-core usable on CPU; a no-op with CUDA present, idempotent otherwise."""
    global _applied
    if _applied or not cuda_absent():
        return
    # megatron allocates buffers with device=torch.cuda.current_device() (~200 places: attention masks, RoPE,
    # the TP gather mappings); on CPU that call raises, so it answers with the CPU device instead.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # the MoE router's gating GEMM goes through Transformer Engine whenever TE imports, and TE asks for CUDA
    # device properties: keep it in torch.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    _applied = True


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
