"""The KD forward step and loss function, on Megatron-Bridge's contracts (``pretrain(cfg, kd_forward_step)``).

Per microbatch: ``get_kd_batch`` takes this stage's part of the next ``cache.KDRow`` (Bridge's own batch function
keeps only tokens/labels/loss_mask/position_ids/attention_mask), on the model's device and cut for context
parallelism (``context_parallel``), with its attention (``row_attention``: plain causal for rows of one document;
rows of several documents, a packed or per-document store's, attend within each document: the block-diagonal mask
on megatron-core's local attention, packed sequences (THD, the rows folded into one) on Transformer Engine's,
``megatron_kd_plugin.documents``); the model runs with GPTModel's ``output_processor`` hook, which hands the
final-norm hidden states [s, b, H] (or [s/tp, b, H] with sequence parallelism), this rank's lm_head shard [V/tp, H]
and a ``loss.KDLossInputs`` to ``loss.kd_loss`` (no [s, b, V/tp] logits; the loss maps hidden into the TP region
itself, so dX is all-reduced, or reduce-scattered, in backward); ``kd_loss_func`` returns Megatron's 3-tuple
``(loss_sum, num_tokens, report)`` from the ``loss.KDLossResult``, the report the loss's ``[sum, count]`` figures.
With Bridge's ``rerun_state_machine.check_for_nan_in_loss`` (on by default) a NaN/Inf loss stops the run there,
through megatron-core's rerun state machine as Bridge's own loss does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_kd_plugin.bridge.context_parallel import slice_kd_batch_for_cp
from megatron_kd_plugin.cache import KDRow
from megatron_kd_plugin.documents import (WINDOW_DROPS_MASK, causal_mask, document_attention, document_attention_mask,
                                          packed_seq_params, several_documents)
from megatron_kd_plugin.loss import KDLossInputs, KDLossResult, kd_loss, tensor_map


class RowAttention(NamedTuple):
    """The attention arguments of the model call for a batch of rows (``megatron_kd_plugin.documents``)."""

    attention_mask: torch.Tensor | None
    """bool [b or 1, 1, S, S], True = masked; None: the attention's own causal mask (GPU) or packed sequences."""
    packed_seq_params: PackedSeqParams | None = None
    """THD packed sequences (Transformer Engine's attention): the rows are then folded into one [1, b·S] sequence."""


def row_attention(position_ids: torch.Tensor, *, attention: str, device: torch.device, cp_size: int = 1
                  ) -> RowAttention:
    """The attention of a batch of rows from its host position_ids [b, S], for this rank's S/cp tokens of each row.

    Rows of one document each keep plain causal attention (``_causal_mask_off_cuda``); a batch with a row of several
    documents gets each document attending within itself, by the model's ``attention``
    (``documents.document_attention``): Transformer Engine's attention the documents as packed sequences,
    megatron-core's local attention the block-diagonal causal mask (on any device). Refused (ValueError): several
    documents under context parallelism (``cp_size`` > 1; megatron-core's load-balanced CP split cuts across
    documents), or on a sliding-window model whose window layers drop the mask (``window_drops_mask``).
    """
    if not several_documents(position_ids):
        return RowAttention(_causal_mask_off_cuda(position_ids.shape[1] // cp_size))
    if cp_size > 1:
        raise ValueError(f"model.context_parallel_size={cp_size} with rows of several documents (a packed or "
                         "document store): context parallelism would split documents; use 1")
    if attention == "window_drops_mask":
        raise ValueError(WINDOW_DROPS_MASK)
    if attention == "packed_sequences":
        return RowAttention(None, packed_seq_params(position_ids, device))
    return RowAttention(document_attention_mask(position_ids).to(device, non_blocking=True))


def get_kd_batch(data_iterator, *, is_first_stage: bool, is_last_stage: bool, cp_group=None,
                 attention: str = "mask") -> tuple[KDRow | None, RowAttention | None]:
    """This stage's part of the next batch (a batch-first ``KDRow``), on the model's device, cut to this rank's S/cp
    tokens when ``cp_group`` has more than one rank (``slice_kd_batch_for_cp``), and its attention
    (``row_attention`` for the model's ``attention``, ``documents.document_attention``; from the rows'
    position ids before they leave the host, so no device-to-host read).

    Middle pipeline stages consume nothing and get (None, None) (their input arrives from the previous stage); the
    first stage's row holds tokens and position_ids, the last stage's labels, loss_mask, the teacher and each row's
    source (both: all). Rows of several documents with more than one stage are refused (ValueError).
    """
    if not (is_first_stage or is_last_stage):
        return None, None
    batch = next(data_iterator)
    if not isinstance(batch, KDRow):
        raise ValueError(f"the KD step's data iterator yielded a {type(batch).__name__}; it must yield KDRow "
                         "batches (a TopKCacheDatasetProvider's datasets)")
    if not (is_first_stage and is_last_stage) and several_documents(batch.position_ids):
        raise ValueError("model.pipeline_model_parallel_size > 1 with rows of several documents (a packed or "
                         "document store): the KD step hands only one-stage models their documents' attention; use 1")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    attention = row_attention(batch.position_ids, attention=attention, device=device, cp_size=cp_size)
    batch = batch._replace(**{} if is_first_stage else dict(tokens=None, position_ids=None),
                           **{} if is_last_stage else dict(labels=None, loss_mask=None, teacher=None, source=None))
    batch = tensor_map(lambda t: t.to(device, non_blocking=True), batch)
    batch = slice_kd_batch_for_cp(batch._replace(source=None), cp_group)._replace(source=batch.source)  # [b]: not cut
    return batch, attention


def _sequence_first(t: torch.Tensor, *, thd: bool) -> torch.Tensor:
    """A per-token tensor [b, s, ...] in the order of the model's hidden states: [s, b, ...], or with the rows
    folded into one packed sequence (``thd``) [b·s, 1, ...]."""
    return (t.reshape(1, -1, *t.shape[2:]) if thd else t).transpose(0, 1)


def _causal_mask_off_cuda(seq_length: int) -> torch.Tensor | None:
    """None on a GPU (the attention kernels are causal by themselves); on CPU the explicit [1, 1, s, s] mask
    (True = masked): megatron-core's local attention would otherwise build its default one on "cuda"."""
    if torch.cuda.is_available():
        return None
    return causal_mask(seq_length)


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
    batch, attention = get_kd_batch(data_iterator, is_first_stage=is_pp_first_stage(pg_collection.pp),
                                    is_last_stage=is_pp_last_stage(pg_collection.pp), cp_group=pg_collection.cp,
                                    attention=document_attention(model))
    if batch is None:   # a middle pipeline stage: rows of one document (several are refused with PP > 1)
        batch, attention = KDRow(None, None, None, None, None), RowAttention(_causal_mask_off_cuda(config.seq_length))
    thd = attention.packed_seq_params is not None
    sequence_first = functools.partial(_sequence_first, thd=thd)
    context = None
    if batch.teacher is not None:
        names = source_names(state.cfg)
        groups = None if not names or batch.source is None else sequence_first(
            batch.source[:, None].expand_as(batch.labels))
        context = KDLossInputs(teacher=tensor_map(sequence_first, batch.teacher),   # [s, b, ...] (THD: [b·s, 1, ...])
                               labels=sequence_first(batch.labels), loss_mask=sequence_first(batch.loss_mask),
                               options=state.cfg.kd, tp_group=pg_collection.tp,
                               sequence_parallel=config.sequence_parallel, groups=groups,
                               group_names=names if groups is not None else ())
    fold = (lambda t: t.reshape(1, -1)) if thd else (lambda t: t)              # [b, s] -> THD [1, b·s]
    packed = {"packed_seq_params": attention.packed_seq_params} if thd else {}
    output = model(input_ids=None if batch.tokens is None else fold(batch.tokens),
                   position_ids=None if batch.position_ids is None else fold(batch.position_ids),
                   attention_mask=attention.attention_mask, labels=None if batch.labels is None else fold(batch.labels),
                   output_processor=_kd_output_processor, output_processor_context=context, **packed)
    return output, functools.partial(kd_loss_func,
                                     check_for_nan_in_loss=state.cfg.rerun_state_machine.check_for_nan_in_loss)
