"""CPU development path: the KD recipe, dataset provider, forward step and loss under a minimal microbatch loop.

Megatron-Bridge's training loop and megatron-core's schedules assume CUDA (``forward_backward_no_pipelining``
allocates ``total_num_tokens`` on "cuda"), so on a machine without CUDA this loop drives the same pieces: it runs
megatron-core's own per-microbatch ``forward_step`` (which applies the ``forward_step_calc_loss`` contract: the
3-tuple loss divided by num_tokens and by the number of microbatches, or, with ``calculate_per_token_loss``, left
summed) and ``backward_step``, then all-reduces gradients over data parallelism, divided by its size (or by the
step's masked-in tokens over DP, as ``finalize_model_grads`` does with ``calculate_per_token_loss``), and, as
megatron's ``finalize_model_grads``, the QK-norm / sequence-parallel norm gradients over TP, clips them by their
TP-aware global norm (megatron-core's rule), and steps a plain ``torch.optim.AdamW`` under Bridge's learning-rate
scheduler. Checkpoints follow Bridge (``cpu_checkpoint``): it resumes from the latest in ``checkpoint.load``, else starts from ``checkpoint.pretrained_checkpoint`` when that is
a HF folder (AutoBridge's weight loading), and saves every ``checkpoint.save_interval`` steps, at the end and when
it stops at ``train.exit_interval`` (Bridge's rules) when ``checkpoint.save`` is set. It logs as Bridge's loop does
(``cpu_log``): a line every ``logger.log_interval`` steps, TensorBoard events through Bridge's writer and the step
history on disk (``<logger.tensorboard_dir>/history.jsonl``) as the run goes. It is not a second trainer:
no evaluation, mixed precision or pipeline parallelism; on a GPU, ``python -m megatron_kd_plugin train`` runs Bridge's
``pretrain()``.

    models, history = train_on_cpu(cfg)   # history[i] = {"step", "loss", "lr", "grad norm", "kd loss", ...}

"loss" is the optimised objective (alpha * tau^2 * KD + (1 - alpha) * CE per masked-in token), normalised as
megatron-core's schedules normalise it: each microbatch's sum over its own tokens, averaged over microbatches and DP
ranks; with ``model.calculate_per_token_loss`` the step's sum over the tokens of all its microbatches and DP ranks
(``finalize_model_grads``' rule; the gradients likewise). The other entries are Bridge's report pairs reduced as
Bridge logs them (sum over microbatches and DP ranks / token count).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from megatron.bridge.data.base import DatasetBuildContext
from megatron.bridge.data.loaders import get_train_valid_test_num_samples
from megatron.bridge.data.samplers import build_pretraining_data_loader
from megatron.bridge.training.config import runtime_config_update
from megatron.bridge.training.optim import _get_scheduler
from megatron.bridge.training.state import GlobalState
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import get_model_config

from megatron_kd_plugin.bridge.cpu_checkpoint import load_checkpoint, save_checkpoint
from megatron_kd_plugin.bridge.cpu_log import StepLog
from megatron_kd_plugin.models.hf import is_hf_checkpoint
from megatron_kd_plugin.models.student import load_hf_weights
from megatron_kd_plugin.bridge.forward_step import kd_forward_step
from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, cuda_absent, seed_model_parallel


class MasterPortInUse(ValueError):
    """The TCP port of ``MASTER_PORT`` (the user's choice) is taken on this machine."""


def init_cpu_distributed(tensor_model_parallel_size: int, *, expert_model_parallel_size: int = 1,
                         expert_tensor_parallel_size: int | None = None) -> None:
    """gloo process group and megatron's parallel state, if not yet, at the model's TP, EP and expert TP (None:
    megatron's default, TP, and not checked against an existing state): the sizes its provider was built with.

    Under torchrun (or with ``RANK``/``WORLD_SIZE`` set) the group comes from the environment, as torch's ``env://``
    reads it. A single process started without them needs no port: its group rendezvous in memory (a ``HashStore``),
    so any number of runs start side by side on one machine; only when the user set ``MASTER_PORT`` is that port
    used, and its being taken is one line naming the variable (``MasterPortInUse``).
    """
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" not in os.environ:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            try:
                dist.init_process_group("gloo")
            except dist.DistNetworkError as error:
                if "EADDRINUSE" not in str(error):
                    raise
                raise MasterPortInUse(
                    f"MASTER_PORT={os.environ['MASTER_PORT']} is already in use on {os.environ['MASTER_ADDR']} "
                    "(another run on this machine?): set MASTER_PORT to a free port, or leave it unset for a single "
                    "process (it then needs none)") from None
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                                 expert_model_parallel_size=expert_model_parallel_size,
                                                 expert_tensor_parallel_size=expert_tensor_parallel_size)
    for name, wanted, initialized in (
            ("tensor_model_parallel_size", tensor_model_parallel_size,
             parallel_state.get_tensor_model_parallel_world_size()),
            ("expert_model_parallel_size", expert_model_parallel_size,
             parallel_state.get_expert_model_parallel_world_size()),
            ("expert_tensor_parallel_size", expert_tensor_parallel_size,
             parallel_state.get_expert_tensor_parallel_world_size())):
        if wanted is not None and initialized != wanted:
            raise ValueError(f"model.{name}={wanted} but megatron's parallel state was initialised with "
                             f"{initialized}")


def _reduce_report(reports: list[dict[str, torch.Tensor]], dp_group) -> dict[str, float]:
    """Sum each ``[sum, count]`` pair over microbatches and data-parallel ranks -> sum / count (Bridge's rule); a
    figure of no tokens in this step (a blend's source no row of the step came from) is left out, not 0/0."""
    pairs = torch.stack([torch.stack([r[key].detach().float() for r in reports]).sum(0) for key in reports[0]])
    dist.all_reduce(pairs, group=dp_group)                                  # [figures, 2], one collective
    return {key: float(pair[0] / pair[1]) for key, pair in zip(reports[0], pairs) if pair[1] != 0}


def _allreduce_replicated_grads_over_tp(model, config) -> None:
    """Sum (or average) over TP the gradients of parameters every TP rank holds whole but sees only part of the
    input for — megatron-core's rule (``finalize_model_grads._allreduce_non_tensor_model_parallel_grads``, which
    needs DDP-wrapped chunks): QK-layernorm weights (each rank normalises its own heads), sequence-parallel norms,
    and parameters marked ``average_gradients_across_tp_domain``. Without it the TP ranks' copies drift apart."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if getattr(param, "average_gradients_across_tp_domain", False):
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=group)
        elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            dist.all_reduce(param.grad, group=group)


def _is_expert(param) -> bool:
    """A MoE expert's parameter (megatron marks them ``allreduce=False``): this rank's experts only, reduced over
    the expert data-parallel group, not the data-parallel one."""
    return not getattr(param, "allreduce", True)


def _reduce_grads_over_data_parallel(params, divisor: torch.Tensor) -> None:
    """What megatron-core's DDP and ``finalize_model_grads`` do: sum each gradient over the ranks that hold the same
    parameter and saw other data (the data-parallel group; for an expert's, the expert data-parallel group: the
    other EP ranks hold other experts) and divide by the step's ``divisor`` (``_step_divisor``; an expert's gradient
    already sums the tokens of its EP group)."""
    groups = {False: parallel_state.get_data_parallel_group(), True: parallel_state.get_expert_data_parallel_group()}
    for param in params:
        dist.all_reduce(param.grad, group=groups[_is_expert(param)])
        param.grad /= divisor


def _step_divisor(num_tokens: torch.Tensor, *, per_token: bool, dp_group) -> torch.Tensor:
    """What a step's summed gradients and losses are divided by, as megatron-core's schedules do: the data-parallel
    size, each rank's loss being already its microbatches' mean of per-microbatch token means (``forward_step``
    divides each microbatch by its ``num_tokens`` and their number); with ``calculate_per_token_loss``
    (``per_token``: ``forward_step`` leaves each microbatch's loss summed), the masked-in tokens of the whole step,
    ``num_tokens`` (int [], this rank's microbatches) summed over data parallelism, at least 1
    (``finalize_model_grads``). float32 []."""
    if not per_token:
        return torch.tensor(float(dist.get_world_size(dp_group)))
    total = num_tokens.clone()
    dist.all_reduce(total, group=dp_group)
    return total.clamp(min=1).float()


def _clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the gradients (TP-duplicated parameters counted once; experts' over the experts' TP x EP x
    PP ranks, which hold different experts), then scale them to ``max_norm`` if above (0: no clipping) —
    megatron-core's rule; its own functions allocate on "cuda"."""
    expert_tp = parallel_state.get_expert_tensor_parallel_group()
    squares = {False: torch.zeros((), dtype=torch.float32), True: torch.zeros((), dtype=torch.float32)}
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p, expert_tp_group=expert_tp):
            squares[_is_expert(p)] += (p.grad.float() ** 2).sum()
    dist.all_reduce(squares[False], group=parallel_state.get_model_parallel_group())
    dist.all_reduce(squares[True], group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    norm = float((squares[False] + squares[True]).sqrt())
    coefficient = max_norm / (norm + 1e-6)
    if max_norm > 0 and coefficient < 1.0:
        for p in params:
            p.grad.mul_(coefficient)
    return norm


def train_on_cpu(cfg, forward_step_func=kd_forward_step, *, progress: bool = True):
    """Train ``cfg`` (a KD recipe) up to ``cfg.train.train_iters`` steps on CPU; returns (model chunks, history of
    the steps run here: a resumed run starts at its checkpoint's step). ``progress``: print the log lines.

    Raises ValueError before step one on anything the run cannot do (bad store, mismatched sizes, PP > 1, CUDA
    present: use Bridge's ``pretrain()`` there).
    """
    if not cuda_absent():
        raise ValueError("CUDA is available: train with Megatron-Bridge's pretrain() "
                         "(python -m megatron_kd_plugin train does)")
    if cfg.model.pipeline_model_parallel_size != 1:
        raise ValueError(f"model.pipeline_model_parallel_size={cfg.model.pipeline_model_parallel_size}: the CPU "
                         "loop runs no pipeline schedule; use 1")
    pretrained = cfg.checkpoint.pretrained_checkpoint
    if pretrained is not None and not is_hf_checkpoint(pretrained):
        raise ValueError(f"checkpoint.pretrained_checkpoint={pretrained}: the CPU loop starts only from a Hugging "
                         "Face checkpoint folder (config.json + *.safetensors)")
    apply_cpu_workarounds()
    moe = bool(getattr(cfg.model, "num_moe_experts", None))            # a dense model has no expert sizes
    init_cpu_distributed(cfg.model.tensor_model_parallel_size,
                         expert_model_parallel_size=cfg.model.expert_model_parallel_size,
                         expert_tensor_parallel_size=cfg.model.expert_tensor_parallel_size if moe else None)
    runtime_config_update(cfg)   # Bridge's finalisation + cfg.validate(), which includes the KD checks
    state = GlobalState()
    state.cfg = cfg
    seed_model_parallel(cfg.rng.seed)
    models = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                  weight_decay=opt.weight_decay)
    scheduler = _get_scheduler(cfg.optimizer, cfg.scheduler, optimizer)
    if not load_checkpoint(state, models, optimizer, scheduler) and pretrained is not None:
        load_hf_weights(models, pretrained)

    dp_group = parallel_state.get_data_parallel_group()
    dp_size = dist.get_world_size(dp_group)
    train_samples, _, _ = get_train_valid_test_num_samples(cfg)
    train_ds, _, _ = cfg.dataset.build_datasets(DatasetBuildContext(train_samples=train_samples, valid_samples=0,
                                                                    test_samples=0))
    loader = build_pretraining_data_loader(   # resumed: from the first sample the checkpointed run had not seen
        train_ds, state.train_state.consumed_train_samples, cfg.dataset.dataloader_type, cfg.train.micro_batch_size,
        cfg.dataset.num_workers, cfg.dataset.data_sharding, pin_memory=False,
        data_parallel_rank=dist.get_rank(dp_group), data_parallel_size=dp_size, global_batch_size=cfg.train.global_batch_size, seed=cfg.dataset.seed)
    data_iterator = iter(loader)
    num_microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)

    model_config = get_model_config(models[0])
    step_func = lambda data_iterator, model: forward_step_func(state, data_iterator, model)  # noqa: E731
    history = []
    steps = range(state.train_state.step, cfg.train.train_iters)
    log = StepLog(state, start_step=steps.start, tokens_per_step=cfg.train.global_batch_size * cfg.model.seq_length,
                  print_lines=progress)
    for step in steps:
        started = time.perf_counter()
        for param in params:
            param.grad = None
        reports, loss, num_tokens = [], torch.zeros(()), torch.zeros((), dtype=torch.int)
        for microbatch in range(num_microbatches):
            output, tokens = forward_step(step_func, data_iterator, models[0], num_microbatches, None, reports,
                                          model_config, cp_group_size=1, is_first_microbatch=microbatch == 0,
                                          current_microbatch=microbatch)
            backward_step(None, output, None, model_config)
            loss += output.detach()   # divided by its num_tokens and num_microbatches, unless calculate_per_token_loss
            num_tokens += tokens
        divisor = _step_divisor(num_tokens, per_token=model_config.calculate_per_token_loss, dp_group=dp_group)
        _reduce_grads_over_data_parallel(params, divisor)
        _allreduce_replicated_grads_over_tp(models[0], model_config)
        grad_norm = _clip_grad_norm(params, opt.clip_grad)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step(increment=cfg.train.global_batch_size)
        dist.all_reduce(loss, group=dp_group)
        history.append({"step": step, "loss": float(loss / divisor), "lr": lr, "grad norm": float(grad_norm),
                        **_reduce_report(reports, dp_group)})
        log.step(history[-1], time.perf_counter() - started)
        state.train_state.step = done = step + 1
        state.train_state.consumed_train_samples += cfg.train.global_batch_size
        exiting = bool(cfg.train.exit_interval) and done % cfg.train.exit_interval == 0   # Bridge's exit rule
        if cfg.checkpoint.save and (done % cfg.checkpoint.save_interval == 0 or done == cfg.train.train_iters
                                    or exiting):
            save_checkpoint(state, models, optimizer, scheduler)
        if exiting:
            break
    log.close()
    return models, history
