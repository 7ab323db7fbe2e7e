"""Qwen3-8B teacher cache -> smaller Qwen3 students at 32K context on H200s (bf16, Transformer Engine layers).

The teacher never runs here: its top-K cache (K=64, 32,768-token samples, Qwen3 vocabulary) is written once by
``megatron_kd_plugin.cache`` and set with ``dataset.cache_path=...``. The student is a Hugging Face checkpoint
(``hf_path``: a local folder, or a hub id resolved to its local snapshot when the recipe is called), the
compressed model to heal: its architecture comes from its ``config.json`` through AutoBridge (Bridge's own
recipes' convention), ``checkpoint.pretrained_checkpoint`` starts training from its weights (set it to null to
train from scratch), and every checkpoint also holds the healed student as a HF folder (``iter_*/hf/``).

    python -m megatron_kd_plugin train --recipe qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config \\
        --hf-path /models/qwen3-0.6b-pruned dataset.cache_path=/data/qwen3_8b_top64_32k.zarr
"""

from __future__ import annotations

from megatron_kd_plugin.bridge.config import KDConfigContainer
from .common import kd_hf_student_config

SEQ_LENGTH = 32768
QWEN3_8B_CACHE = "outputs/caches/qwen3_8b_top64_32k.zarr"
QWEN3_0P6B = "Qwen/Qwen3-0.6B"
QWEN3_1P7B = "Qwen/Qwen3-1.7B"


def qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config(hf_path: str = QWEN3_0P6B) -> KDConfigContainer:
    """Qwen3-8B -> a Qwen3-0.6B-shaped student at 32K on one H200: no model parallelism, selective recompute,
    16 x 32K tokens a step. The fused loss keeps the [32K, 151,936] logits (19 GB in fp32) from ever existing.
    Planner: 53.5 GiB with the fused loss (weights 1.1, gradients 2.2, optimizer 6.7, activations 42.3, the larger
    of loss head 1.3 and backward 0.4), margin 72.5 GiB to the 90 % line; forward-chunked 90.1 GiB would fit too,
    the megatron-core peer (126.5) would not."""
    cfg = kd_hf_student_config(hf_path, cache_path=QWEN3_8B_CACHE, run_name="qwen3_8b_to_0p6b_kd_32k",
                               seq_length=SEQ_LENGTH)
    cfg.model.recompute_granularity = "selective"
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 1
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False   # one rank: nothing to overlap
    return cfg


def qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config(hf_path: str = QWEN3_1P7B) -> KDConfigContainer:
    """Qwen3-8B -> a Qwen3-1.7B-shaped student at 32K on 8 H200s: TP=2 with sequence parallelism, PP=2, DP=2."""
    cfg = kd_hf_student_config(hf_path, cache_path=QWEN3_8B_CACHE, run_name="qwen3_8b_to_1p7b_kd_32k",
                               seq_length=SEQ_LENGTH, tensor_parallel=2, pipeline_parallel=2)
    cfg.model.sequence_parallel = True
    cfg.model.recompute_granularity = "selective"
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, 1
    return cfg
