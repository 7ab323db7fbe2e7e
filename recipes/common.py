"""The one base every KD recipe starts from; recipes set only their deltas (model, parallelism, batch, precision)."""

from __future__ import annotations

import os

from megatron.bridge.models import GPTModelProvider
from megatron.bridge.training.config import (
    CheckpointConfig,
    DistributedDataParallelConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)

from megatron_kd_plugin.bridge.config import KDConfigContainer
from megatron_kd_plugin.loss import KDLossOptions
from megatron_kd_plugin.bridge.provider import TopKCacheDatasetProvider
from megatron_kd_plugin.models.student import resolve_hf_folder, student_provider


def kd_common_config(model: GPTModelProvider, *, cache_path: str, run_name: str) -> KDConfigContainer:
    """A KD run of ``model`` on the teacher cache at ``cache_path``: Adam + cosine, forward KL with a ghost tail.

    The dataset's seq_length is the model's; the tokenizer is a NullTokenizer of the model's vocabulary, sized when
    the config is validated (after overrides; the cache holds token ids already). NaN/Inf are checked in the loss
    (Bridge's rerun state machine, on by default) and in the gradients (``ddp.check_for_nan_in_grad``). Checkpoints
    go to ``outputs/<run_name>/checkpoints``, which is also ``checkpoint.load``: a rerun resumes from the latest.
    """
    run_dir = os.path.join("outputs", run_name)
    return KDConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=1000, global_batch_size=16, micro_batch_size=1),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=1e-5, weight_decay=0.01, adam_beta1=0.9,
                                  adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, use_distributed_optimizer=True),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=50, start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                          overlap_grad_reduce=True, overlap_param_gather=True,
                                          check_for_nan_in_grad=True),
        dataset=TopKCacheDatasetProvider(cache_path=cache_path, seq_length=model.seq_length, num_workers=2),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=os.path.join(run_dir, "tb_logs")),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=None),   # validate(): the model's
        checkpoint=CheckpointConfig(save=os.path.join(run_dir, "checkpoints"),
                                    load=os.path.join(run_dir, "checkpoints"), save_interval=500,
                                    ckpt_format="torch_dist"),
        rng=RNGConfig(seed=1234),
        mixed_precision="bf16_mixed",
        kd=KDLossOptions(),
    )


def kd_hf_student_config(hf_path: str, *, cache_path: str, run_name: str, seq_length: int, tensor_parallel: int = 1,
                         pipeline_parallel: int = 1) -> KDConfigContainer:
    """``kd_common_config`` of the student at ``hf_path`` (a HF checkpoint folder or hub id): its architecture
    through AutoBridge, training from its weights (``checkpoint.pretrained_checkpoint``), each checkpoint also
    exported as a HF folder (``checkpoint.also_save_hf_checkpoint``, templated on the student's own files).

    A heal: pure KD (``kd.alpha`` 1), forward KL at tau 1 with the ``renorm`` tail. Measured on the demo's pruned
    Qwen3, two seeds (docs/benchmarks.md, the heal sweeps): renorm healed more than ghost (at 100, 200 and 300 steps), tau 2
    and reverse KL / JSD no better than tau 1 forward KL, and every alpha < 1 less than 1 (at lr 1e-3 it left the
    student further from its teacher than pruning had). renorm trains only the shape within the teacher's top-K and
    never moves the student's mass outside it, which a trained student already holds: a student far from its teacher
    there (from random weights, or pruned past repair) wants ``kd.tail=ghost``. A sampled store (``cache --draws N``;
    64 draws healed the demo's student more than the top-100 at 0.87x its bytes) takes ``kd.tail=sampled``, and the
    rows refuse any other tail before step one, naming it. Judgement, not measured here: the learning rate of these
    GPU recipes, 1e-4 with cosine to 1e-5 (the demo's 3M-parameter student healed best at 1e-3; a 0.6B-8B student
    takes a smaller step; 1e-4 peak, cosine decay, tens of warm-up steps, logit-only KL is what NVIDIA's Minitron used
    to heal pruned 4B-8B models, arXiv 2408.11796)."""
    folder = resolve_hf_folder(hf_path)
    model = student_provider(folder, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    model.seq_length = seq_length
    model.cross_entropy_loss_fusion = False   # the KD loss replaces the output layer's cross entropy
    cfg = kd_common_config(model, cache_path=cache_path, run_name=run_name)
    cfg.checkpoint.pretrained_checkpoint = cfg.checkpoint.hf_source_path = folder
    cfg.checkpoint.also_save_hf_checkpoint = True
    cfg.kd.tail = "renorm"
    return cfg
