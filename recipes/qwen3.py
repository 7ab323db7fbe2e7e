"""Qwen3-8B teacher cache -> smaller Qwen3 students at 32K context on H200s (bf16, Transformer Engine layers).

The teacher never runs here: its top-K cache (K=64, 32,768-token samples, Qwen3 vocabulary) is written once by
``megatron_kd_plugin.cache`` and set with ``dataset.cache_path=...``. Students are built from the published Qwen3
architectures (no Hugging Face download at recipe time); start from pretrained weights with
``checkpoint.pretrained_checkpoint=<megatron checkpoint>`` (Bridge's HF -> Megatron conversion) or train from
scratch.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.bridge.models import GPTModelProvider

from megatron_kd_plugin.bridge.config import KDConfigContainer
from recipes.common import kd_common_config

SEQ_LENGTH = 32768
QWEN3_VOCAB_SIZE = 151936
QWEN3_8B_CACHE = "outputs/caches/qwen3_8b_top64_32k.zarr"


def qwen3_student(*, num_layers: int, hidden_size: int, ffn_hidden_size: int) -> GPTModelProvider:
    """A Qwen3 dense architecture (16 query heads, 8 KV groups of 128 dims, QK-norm, SwiGLU, RMSNorm, RoPE 1e6,
    tied embeddings) at 32K context."""
    return GPTModelProvider(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=16, num_query_groups=8, kv_channels=128, qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope", rotary_base=1000000,
        share_embeddings_and_output_weights=True, vocab_size=QWEN3_VOCAB_SIZE, make_vocab_size_divisible_by=128,
        seq_length=SEQ_LENGTH, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        cross_entropy_loss_fusion=False,   # the KD loss replaces the output layer's cross entropy
    )


def qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config() -> KDConfigContainer:
    """Qwen3-8B -> Qwen3-0.6B at 32K on one H200: no model parallelism, selective recompute, 16 x 32K tokens a step.

    The fused loss keeps the [32K, 151,936] logits (19 GB in fp32) from ever existing."""
    model = qwen3_student(num_layers=28, hidden_size=1024, ffn_hidden_size=3072)
    model.recompute_granularity = "selective"
    cfg = kd_common_config(model, cache_path=QWEN3_8B_CACHE, run_name="qwen3_8b_to_0p6b_kd_32k")
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 1
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False   # one rank: nothing to overlap
    return cfg


def qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config() -> KDConfigContainer:
    """Qwen3-8B -> Qwen3-1.7B at 32K on 8 H200s: TP=2 with sequence parallelism, PP=2, DP=2."""
    model = qwen3_student(num_layers=28, hidden_size=2048, ffn_hidden_size=6144)
    model.tensor_model_parallel_size, model.sequence_parallel = 2, True
    model.pipeline_model_parallel_size = 2
    model.recompute_granularity = "selective"
    cfg = kd_common_config(model, cache_path=QWEN3_8B_CACHE, run_name="qwen3_8b_to_1p7b_kd_32k")
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, 1
    return cfg
