"""Long-context healing: Qwen3 students distilled at 128K with context parallelism on 8 H200s, and at the longest
context one H200 holds (by ``python -m megatron_kd_plugin plan``). Each states the per-GPU memory the planner
expects; the fused loss keeps its head flat in T (chunk + dX + dW), so activations set what fits.

The teacher cache holds samples of the recipe's seq_length (set ``dataset.cache_path=...``); with CP every
per-token tensor of a row is split like the tokens (``megatron_kd_plugin.bridge.context_parallel``).
"""

from __future__ import annotations

from megatron_kd_plugin.bridge.config import KDConfigContainer
from .common import kd_hf_student_config
from .qwen3 import QWEN3_0P6B, QWEN3_1P7B


def qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config(hf_path: str = QWEN3_1P7B) -> KDConfigContainer:
    """Qwen3-8B -> Qwen3-1.7B at 128K on 8 H200s: CP=8 (16K tokens a rank), selective recompute, 16 x 128K tokens a
    step. Planner: 46.4 GiB per GPU with the fused loss (weights 3.2, gradients 6.4, optimizer 2.4, activations
    32.6, the larger of loss head 1.8 and backward 0.4), margin 79.6 GiB to the 90 % line; the megatron-core peer's
    head alone would take 37.2."""
    cfg = kd_hf_student_config(hf_path, cache_path="outputs/caches/qwen3_8b_top64_128k.zarr",
                               run_name="qwen3_8b_to_1p7b_kd_128k", seq_length=131072)
    cfg.model.context_parallel_size = 8
    cfg.model.recompute_granularity = "selective"
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 1
    return cfg


def qwen3_8b_to_0p6b_kd_768k_1gpu_h200_bf16_config(hf_path: str = QWEN3_0P6B) -> KDConfigContainer:
    """Qwen3-8B -> Qwen3-0.6B at 768K (786,432) tokens on one H200: full recompute of every layer, 4 x 768K tokens a
    step. It promised 1M until the planner counted what megatron-core's layers keep: 1M plans at 130.7 GiB, over
    the 126 GiB (90 %) line; 768K is the longest multiple of 128K whose plan stays within 80 % of the GPU (896K
    plans at 115.6 GiB, over 112 GiB; the recipe was ``qwen3_8b_to_0p6b_kd_1m_1gpu_h200_bf16_config``). Planner:
    100.5 GiB with the fused loss (weights 1.1, gradients 2.2, optimizer 6.7, activations 45.0, KD batch 0.4, the
    larger of loss head 5.6 and backward 45.1, the recomputed layer's), margin 25.5 GiB to the 90 % line;
    forward-chunked would need 951 GiB. Attention work grows as s^2: a step is long; ``model.seq_length=N
    dataset.seq_length=N`` shortens it."""
    cfg = kd_hf_student_config(hf_path, cache_path="outputs/caches/qwen3_8b_top64_768k.zarr",
                               run_name="qwen3_8b_to_0p6b_kd_768k", seq_length=786432)
    model = cfg.model
    model.recompute_granularity, model.recompute_method, model.recompute_num_layers = "full", "uniform", 1
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 1
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False   # one rank: nothing to overlap
    return cfg
