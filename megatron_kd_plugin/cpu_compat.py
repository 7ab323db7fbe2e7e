"""The megatron-core work-arounds needed to run on a machine without CUDA — all of them, in one place.

Every work-around is applied only when ``torch.cuda.is_available()`` is False; on a GPU these functions leave
megatron-core untouched, so a GPU run never silently takes a CPU path. What runs on CPU with them: megatron-core's
GPTModel with its local (non-Transformer-Engine) layers, tensor parallelism over gloo, forward and backward.
What does not: Transformer Engine layers, sequence parallelism through TE/apex norms, megatron-core's and
Megatron-Bridge's training schedules (they allocate on "cuda"; see ``megatron_kd_plugin.bridge.cpu_train``).
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
    _applied = True


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
