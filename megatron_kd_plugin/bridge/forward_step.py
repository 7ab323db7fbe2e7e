"""The KD forward step and loss function, on Megatron-Bridge's contracts (``pretrain(cfg, kd_forward_step)``).

Per microbatch: ``get_kd_batch`` takes this stage's part of the next ``cache.KDRow`` (Bridge's own batch function
keeps only tokens/labels/loss_mask/position_ids/attention_mask), on the model's device and cut for context
parallelism (``context_parallel``); the model runs with GPTModel's ``output_processor`` hook, which hands the
final-norm hidden states [s, b, H] (or [s/tp, b, H] with sequence parallelism), this rank's lm_head shard [V/tp, H]
and a ``loss.KDLossInputs`` to ``loss.kd_loss`` (no [s, b, V/tp] logits; the loss maps hidden into the TP region
itself, so dX is all-reduced, or reduce-scattered, in backward); ``kd_loss_func`` returns Megatron's 3-tuple
``(loss_sum, num_tokens, report)`` from the ``loss.KDLossResult``, the report the loss's ``[sum, count]`` figures.
With Bridge's ``rerun_state_machine.check_for_nan_in_loss`` (on by default) a NaN/Inf loss stops the run there,
through megatron-core's rerun state machine as Bridge's own loss does.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_kd_plugin.bridge.context_parallel import slice_kd_batch_for_cp
from megatron_kd_plugin.cache import KDRow
from megatron_kd_plugin.loss import KDLossInputs, KDLossResult, kd_loss, tensor_map


def get_kd_batch(data_iterator, *, is_first_stage: bool, is_last_stage: bool, cp_group=None) -> KDRow | None:
    """This stage's part of the next batch (a batch-first ``KDRow``), on the model's device, cut to this rank's S/cp
    tokens when ``cp_group`` has more than one rank (``slice_kd_batch_for_cp``).

    Middle pipeline stages consume nothing and get None (their input arrives from the previous stage); the first
    stage's row holds tokens and position_ids, the last stage's labels, loss_mask, the teacher and each row's source
    (both: all).
    """
    if not (is_first_stage or is_last_stage):
        return None
    batch = next(data_iterator)
    if not isinstance(batch, KDRow):
        raise ValueError(f"the KD step's data iterator yielded a {type(batch).__name__}; it must yield KDRow "
                         "batches (a TopKCacheDatasetProvider's datasets)")
    batch = batch._replace(**{} if is_first_stage else dict(tokens=None, position_ids=None),
                           **{} if is_last_stage else dict(labels=None, loss_mask=None, teacher=None, source=None))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batch = tensor_map(lambda t: t.to(device, non_blocking=True), batch)
    return slice_kd_batch_for_cp(batch._replace(source=None), cp_group)._replace(source=batch.source)   # [b]: not cut


def _causal_mask_off_cuda(seq_length: int) -> torch.Tensor | None:
    """None on a GPU (the attention kernels are causal by themselves); on CPU the explicit [1, 1, s, s] mask
    (True = masked): megatron-core's local attention would otherwise build its default one on "cuda"."""
    if torch.cuda.is_available():
        return None
    return torch.ones(seq_length, seq_length, dtype=torch.bool).triu(1).view(1, 1, seq_length, seq_length)


def run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """What calling ``module`` does before its forward, without the forward: run its forward pre-hooks.

    megatron-core's DDP waits for a parameter's overlapped all-gather (``overlap_param_gather``) only in a forward
    pre-hook of the module that owns it, and that wait also dispatches the next bucket's gather. A loss that reads
    ``module.weight`` without calling ``module`` must run them, or it reads a weight still being gathered and the
    next dispatch trips ``assert self.param_gather_handle is None``. megatron-core's fused expert implementation
    does the same for its skipped submodules; as there, a hook that would rewrite the input is refused.
    """
    for hook_id, hook in module._forward_pre_hooks.items():
        with_kwargs = hook_id in module._forward_pre_hooks_with_kwargs
        if (hook(module, (), {}) if with_kwargs else hook(module, ())) is not None:
            raise RuntimeError(f"a forward pre-hook of {type(module).__name__} rewrites its input; the KD loss "
                               "reads the weight without calling the module and cannot honour it")


def _kd_output_processor(*, hidden_states, output_layer, output_weight, context: KDLossInputs,
                         **_) -> KDLossResult:
    """GPTModel ``output_processor``: final hidden states + lm_head shard -> the rows' fused KD loss.

    The weight is ``output_layer``'s (untied, or tied on a last stage without the embedding), whose forward never
    runs, so its pre-hooks (DDP's gather wait) run here; with tied embeddings on the first stage it is the
    embedding's, whose module already ran, and ``output_layer`` owns no parameter for its hooks to wait on. A caller
    that hands only ``output_weight`` (``output_layer=None``) owns the weight's readiness itself.
    """
    if output_layer is not None:
        run_forward_pre_hooks(output_layer)
    weight = output_weight if output_weight is not None else output_layer.weight   # [V/tp, H]
    return kd_loss(hidden_states, weight, context)


def validate_local_loss(loss: torch.Tensor) -> None:
    """Bridge's NaN/Inf check of one rank's loss before the DP all-reduce (``training/losses.py``): through
    megatron-core's rerun state machine, fatal (with reruns disabled: a RuntimeError naming rank and iteration)."""
    rerun_state_machine = get_rerun_state_machine()
    for rejection_func, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        rerun_state_machine.validate_result(result=loss, rejection_func=rejection_func,
                                            message=f"found {name} in local forward KD loss calculation",
                                            tolerance=0.0, fatal=True)   # the forward is deterministic


def kd_loss_func(output_tensor, *, check_for_nan_in_loss: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's 3-tuple loss contract from the loss's ``KDLossResult`` (or the plain tuple a bf16
    ``Float16Module`` turns it into); ``check_for_nan_in_loss`` (Bridge's
    ``rerun_state_machine.check_for_nan_in_loss``) validates the loss sum."""
    result = KDLossResult(*output_tensor)
    if check_for_nan_in_loss:
        validate_local_loss(result.loss_sum)
    return result.loss_sum, result.num_tokens.to(torch.int), result.report


def check_no_mtp(config) -> None:
    """ValueError for a student with multi-token-prediction heads (``mtp_num_layers``): given labels, GPTModel's MTP
    path (``process_mtp_loss``) builds full [s, b, V] logits through ``output_layer`` and trains the heads on
    hard-label CE, which the KD step neither wants nor pays for."""
    if getattr(config, "mtp_num_layers", None):
        raise ValueError(f"model.mtp_num_layers={config.mtp_num_layers}: the KD step does not train multi-token "
                         "prediction heads (they would build full [s, b, V] logits); set model.mtp_num_layers=None")


def source_names(cfg) -> tuple[str, ...]:
    """The names of the run's sources when it reads several (a blend: ``TopKCacheDatasetProvider.source_names``),
    whose figures the loss then reports apart (``kd loss [NAME]``); () for one source, or a caller's config without
    a KD dataset (the GPU check's)."""
    return getattr(getattr(cfg, "dataset", None), "source_names", ())


def kd_forward_step(state, data_iterator, model, return_schedule_plan: bool = False):
    """Bridge forward step: ``(output, partial(kd_loss_func, ...))``; reads ``state.cfg.kd`` (the run's
    ``loss.KDLossOptions``). A run of several sources (a blend) also reports each source's ``kd loss [NAME]`` (and
    ``lm loss [NAME]``), from each row's ``source`` (``source_names``); Bridge's evaluation sums them alike."""
    if return_schedule_plan:
        raise ValueError("kd_forward_step does not build MoE overlap schedule plans "
                         "(set model.overlap_moe_expert_parallel_comm=False)")
    config = get_model_config(model)
    check_no_mtp(config)
    pg_collection = get_attr_wrapped_model(model, "pg_collection")
    batch = get_kd_batch(data_iterator, is_first_stage=is_pp_first_stage(pg_collection.pp),
                         is_last_stage=is_pp_last_stage(pg_collection.pp), cp_group=pg_collection.cp)
    batch = batch if batch is not None else KDRow(None, None, None, None, None)
    context = None
    if batch.teacher is not None:
        names = source_names(state.cfg)
        groups = None if not names or batch.source is None else batch.source[None, :].expand_as(batch.labels.t())
        context = KDLossInputs(teacher=tensor_map(lambda t: t.transpose(0, 1), batch.teacher),   # [s, b, ...]
                               labels=batch.labels.t(), loss_mask=batch.loss_mask.t(), options=state.cfg.kd,
                               tp_group=pg_collection.tp, sequence_parallel=config.sequence_parallel,
                               groups=groups, group_names=names if groups is not None else ())
    output = model(input_ids=batch.tokens, position_ids=batch.position_ids,
                   attention_mask=_causal_mask_off_cuda(config.seq_length if batch.tokens is None
                                                        else batch.tokens.shape[1]),
                   labels=batch.labels, output_processor=_kd_output_processor, output_processor_context=context)
    return output, functools.partial(kd_loss_func,
                                     check_for_nan_in_loss=state.cfg.rerun_state_machine.check_for_nan_in_loss)
