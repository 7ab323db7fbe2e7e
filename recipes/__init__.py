"""KD recipes: zero-argument functions returning a Megatron-Bridge ConfigContainer (a ``KDConfigContainer``).

    python -m megatron_kd_plugin train --recipe tiny_gpt_kd_cpu_fp32_config dataset.cache_path=cache.zarr train.train_iters=8

``*_h200_bf16_config``: GPU runs (bf16, Transformer Engine layers); ``*_cpu_fp32_config``: CPU runs (fp32).
"""

from .cpu import hf_student_kd_cpu_fp32_config
from .cross_tokenizer_students import (
    llama3_8b_to_qwen3_0p6b_xtok_kd_8k_1gpu_h200_bf16_config,
    tiny_gpt_xtok_kd_cpu_fp32_config,
)
from .long_context import qwen3_8b_to_0p6b_kd_768k_1gpu_h200_bf16_config, qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config
from .qwen3 import qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config, qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config
from .tiny import tiny_gpt_kd_cpu_fp32_config

RECIPES = {fn.__name__: fn for fn in (
    qwen3_8b_to_0p6b_kd_768k_1gpu_h200_bf16_config, qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config,
    qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config,
    qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config,
    tiny_gpt_kd_cpu_fp32_config, hf_student_kd_cpu_fp32_config,
    llama3_8b_to_qwen3_0p6b_xtok_kd_8k_1gpu_h200_bf16_config, tiny_gpt_xtok_kd_cpu_fp32_config,
)}

__all__ = sorted(RECIPES)
