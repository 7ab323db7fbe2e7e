"""Healing a Hugging Face student on CPU: the same HF student path as the H200 recipes (AutoBridge in, KD from a
teacher cache, HF folder out), at settings a CPU runs: fp32 (no mixed precision), no recompute, no data-loader
workers, no distributed optimizer. Not a GPU recipe (on a GPU it would train in fp32).

    python -m megatron_kd_plugin train --recipe hf_student_kd_cpu_fp32_config --hf-path pruned/ --seq-length 256 \\
        dataset.cache_path=teacher_cache.zarr

``--seq-length`` (the recipe's ``seq_length``) sets the model's and the dataset's, which must be the cache's.
"""

from __future__ import annotations

from megatron_kd_plugin.bridge.config import KDConfigContainer
from .common import kd_hf_student_config
from .qwen3 import QWEN3_0P6B


def hf_student_kd_cpu_fp32_config(hf_path: str = QWEN3_0P6B, seq_length: int = 256) -> KDConfigContainer:
    """A HF student healed on CPU: fp32, TP=1, 300 steps of 8 rows (one microbatch) at ``seq_length``, pure KD
    (alpha 1) with the renorm tail, Adam at 1e-3 with 30 warm-up steps then cosine to 1e-4; checkpoints (each also a
    HF folder) every 500 steps and at the end in ``outputs/hf_student_kd_cpu/checkpoints`` (resumed from there),
    TensorBoard events and the step history beside them in ``tb_logs``. The loss, learning rate and length are the
    heal sweeps' winners for a top-K store on the demo's pruned Qwen3 (two seeds, docs/benchmarks.md): 300 steps at 1e-3
    won back 86-90 % of the perplexity pruning cost; a smaller rate healed less, 2e-3 and above less again. A sampled
    store (``cache --draws N``, the demo's) takes ``kd.tail=sampled``."""
    cfg = kd_hf_student_config(hf_path, cache_path="outputs/caches/teacher.zarr", run_name="hf_student_kd_cpu",
                               seq_length=seq_length)
    cfg.mixed_precision = None
    cfg.model.recompute_granularity = None
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 300, 8, 8
    cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.bf16 = 1e-3, 1e-4, False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    cfg.scheduler.lr_warmup_iters = 30
    cfg.dataset.num_workers, cfg.dataset.pin_memory = 0, False
    return cfg
