"""A tiny student that trains on CPU in seconds: the CPU development path of the same provider/step/loss.

Its cache comes from a tiny teacher written by ``megatron_kd_plugin.cache`` (``dataset.cache_path=...``); the
student's vocabulary must hold the teacher's ids (``model.vocab_size=...``). It starts from random weights and
writes no checkpoints unless asked (``checkpoint.save=DIR checkpoint.load=DIR``: save there, resume from there),
and no TensorBoard events or step history unless asked (``logger.tensorboard_dir=DIR``).
"""

from __future__ import annotations

import torch
from megatron.bridge.models import GPTModelProvider

from megatron_kd_plugin.bridge.config import KDConfigContainer
from megatron_kd_plugin.cpu_compat import local_block_spec
from .common import kd_common_config


def tiny_gpt_kd_cpu_fp32_config() -> KDConfigContainer:
    """2-layer, 64-wide student at seq_length 32, fp32, 4 steps of 2 microbatches of 2 rows, on CPU."""
    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256,
        make_vocab_size_divisible_by=1, seq_length=32, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0,
        transformer_layer_spec=local_block_spec, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )
    cfg = kd_common_config(model, cache_path="outputs/caches/tiny_teacher.zarr", run_name="tiny_gpt_kd_cpu")
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 4, 2
    cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.bf16 = 3e-3, 3e-3, False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.scheduler.lr_decay_style, cfg.scheduler.lr_warmup_iters = "constant", 0
    cfg.dataset.num_workers, cfg.dataset.pin_memory = 0, False
    cfg.logger.log_interval = 1
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    cfg.mixed_precision = None
    return cfg
