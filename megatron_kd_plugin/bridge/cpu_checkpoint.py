"""Checkpoints of the CPU loop in Megatron-Bridge's layout, written and read by megatron-core's dist_checkpointing.

    <checkpoint.save>/latest_train_state.pt     Bridge's tracker: the TrainState of the latest save (written last)
    <checkpoint.save>/iter_0000004/             Bridge's get_checkpoint_name(save, 4)
        torch_dist shards of {"model", "optimizer", "opt_param_scheduler", "rng_state"} (Bridge's keys)
        train_state.pt, run_config.yaml         (the run's config: a resume checks its dataset, ``resume.py``)
        hf/                                     checkpoint.also_save_hf_checkpoint: the student as a HF folder

"model" is GPTModel's own sharded state dict (TP shards as megatron saves them, so a checkpoint written at one TP
size loads at another); "optimizer" is the AdamW state sharded like the parameters (megatron-core's
``optim_state_to_sharding_state``, the rule of its FP32Optimizer, with one common step). Bridge's own
``save_checkpoint`` cannot run here: its module imports ModelOpt (GPU installs only) and it needs a
MegatronOptimizer. Resuming follows Bridge: a checkpoint in ``checkpoint.load`` wins over
``checkpoint.pretrained_checkpoint``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.bridge.training.utils.checkpoint_utils import (
    checkpoint_exists,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_train_state_filename,
    read_train_state,
)
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

from megatron_kd_plugin.bridge.resume import TRACKER_PREFIX, check_resume_data
from megatron_kd_plugin.cpu_compat import dist_checkpointing_on_cpu


def _optimizer_params(optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _init_optimizer_state(optimizer) -> None:
    """AdamW's state before its first step, so a load has tensors to fill (FP32Optimizer's ``init_state_fn``)."""
    for param in _optimizer_params(optimizer):
        if not optimizer.state[param]:
            optimizer.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _sharded_state(model, optimizer, scheduler) -> dict:
    """What a checkpoint holds, as a megatron-core sharded state dict (the template a load fills)."""
    model_state = model.sharded_state_dict()
    optimizer_state = optimizer.state_dict()
    steps = {float(state["step"]) for state in optimizer_state["state"].values()}
    if len(steps) > 1:
        raise ValueError(f"optimizer steps differ per parameter ({sorted(steps)}): not a checkpointable state")
    optim_state_to_sharding_state(optimizer_state, get_param_id_to_sharded_param_map(
        model_state, _optimizer_params(optimizer)), exclude_keys="step")
    optimizer_state["common_step"] = steps.pop() if steps else 0.0
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"model": model_state, "optimizer": optimizer_state, "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)}


def save_checkpoint(state, models: list, optimizer, scheduler) -> str:
    """Save at ``state.train_state.step`` into ``cfg.checkpoint.save`` (collective); returns the iteration folder."""
    cfg = state.cfg
    dist_checkpointing_on_cpu()
    folder = get_checkpoint_name(cfg.checkpoint.save, state.train_state.step)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(models[0], optimizer, scheduler), folder)
    if cfg.checkpoint.also_save_hf_checkpoint:
        from megatron_kd_plugin.models.student import save_hf

        save_hf(models, cfg.checkpoint.hf_source_path or cfg.checkpoint.pretrained_checkpoint,
                os.path.join(folder, "hf"))
    if dist.get_rank() == 0:
        train_state = state.train_state.state_dict()
        torch.save(train_state, get_checkpoint_train_state_filename(folder))
        cfg.to_yaml(get_checkpoint_run_config_filename(folder))
        tracker = get_checkpoint_train_state_filename(cfg.checkpoint.save, prefix=TRACKER_PREFIX)
        torch.save(train_state, tracker + ".tmp")
        os.replace(tracker + ".tmp", tracker)   # the save counts once the tracker names it
    dist.barrier()
    return folder


def load_checkpoint(state, models: list, optimizer, scheduler) -> bool:
    """Resume from the latest checkpoint in ``cfg.checkpoint.load`` (model, optimizer, scheduler, RNG, train
    state) if it holds one; False (nothing changed) otherwise. ValueError, before anything is loaded, when that
    checkpoint was trained on other data (``resume.check_resume_data``)."""
    load_dir = state.cfg.checkpoint.load
    if not checkpoint_exists(load_dir):
        return False
    check_resume_data(state.cfg)
    read_train_state.cache_clear()   # Bridge caches it by file name; a rerun in this process saved a newer one
    train_state = read_train_state(get_checkpoint_train_state_filename(load_dir, prefix=TRACKER_PREFIX))
    _init_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state(models[0], optimizer, scheduler),
                                     get_checkpoint_name(load_dir, train_state.step))
    models[0].load_state_dict(loaded["model"])
    optimizer_state = loaded["optimizer"]
    step = torch.tensor(float(optimizer_state.pop("common_step")))
    for param_state in optimizer_state["state"].values():
        param_state["step"] = step.clone()
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng = loaded["rng_state"]
    torch.set_rng_state(rng["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    state.train_state = train_state
    return True
