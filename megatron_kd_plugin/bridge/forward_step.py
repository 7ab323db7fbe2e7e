"""The KD forward step and loss function, on Megatron-Bridge's contracts (``pretrain(cfg, kd_forward_step)``).

Per microbatch:
  1. ``get_kd_batch`` takes the next batch-first dict from the data iterator, keeps what this pipeline stage needs
     (first: tokens, position_ids; last: labels, loss_mask, teacher_ids, teacher_logprobs, and
     teacher_sample_weights when a sampled store yields them) and moves it to the model's device; the weights
     reach the loss as ``sample_weights``. With context parallelism every tensor is cut to this CP rank's S/cp
     tokens (``context_parallel.slice_kd_batch_for_cp``). Bridge's own batch function cannot be used: it drops
     unknown keys (the teacher tensors).
  2. The model runs with GPTModel's ``output_processor`` hook: on the last stage the final-norm hidden states
     [s, b, H] (or [s/tp, b, H] with sequence parallelism) and this rank's lm_head shard [V/tp, H] go straight
     into ``topk_kd_loss``; no [s, b, V/tp] logits are built. The loss maps hidden through
     ``copy_to_tensor_model_parallel_region`` (``gather_from_sequence_parallel_region`` with SP) itself, so dX is
     all-reduced (reduce-scattered) across TP in backward.
  3. ``kd_loss_func`` returns Megatron's 3-tuple ``(loss_sum, num_tokens, report)``; the schedule divides by
     num_tokens and the number of microbatches. ``report`` holds ``[sum, count]`` pairs: ``kd loss``,
     ``lm loss`` (only when alpha < 1), ``student top-K mass`` and ``teacher top-K mass``. With Bridge's
     ``rerun_state_machine.check_for_nan_in_loss`` (on by default) a NaN/Inf loss stops the run there, through
     megatron-core's rerun state machine as Bridge's own loss does.

Cross-tokenizer rows (``CrossTokenizerDataset``, issue #18) carry ``chunk_ids`` and ``teacher_chunk_logprobs``, and
the pair arrays (the teacher's top-K in the student's ids and each position's pair): the last stage then takes the
first two (and, when ``kd.token_weight`` > 0, the pair arrays, expanded on its device by ``cache.pair_topk`` into
the pair tokens' ``teacher_ids`` / ``teacher_logprobs``), the loss is ``chunk_likelihood_loss`` (the ALM chunk term
with ``kd.divergence``, ``kd.jsd_beta``, ``kd.temperature`` as the binarisation temperature, ``kd.alpha``,
``kd.chunk_bytes``, ``kd.kernels``, and the token-level term with ``kd.token_weight``), and the report holds ``chunk
loss``, ``lm loss``, ``chunks`` (per token) and ``chunk gap`` (mean |t_c - s_c| in nats per chunk), and with the
token-level term ``token kd loss`` (per pair) and ``pairs`` (per token). Context parallelism would split chunks
across ranks: refused.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_kd_plugin.bridge.context_parallel import slice_kd_batch_for_cp
from megatron_kd_plugin.cache import CHUNK_IDS, CHUNK_LOGPROBS, PAIR_KEYS, SAMPLE_WEIGHTS, pair_topk
from megatron_kd_plugin.loss import KDLossResult, topk_kd_loss
from megatron_kd_plugin.loss.cross_tokenizer import ChunkLossResult, chunk_likelihood_loss

FIRST_STAGE_KEYS = ("tokens", "position_ids")
LAST_STAGE_KEYS = ("labels", "loss_mask", "teacher_ids", "teacher_logprobs")
CROSS_TOKENIZER_KEYS = ("labels", "loss_mask", CHUNK_IDS, CHUNK_LOGPROBS)
"""The last stage's keys for cross-tokenizer rows (a batch holding ``chunk_ids``); with the token-level term
(``pairs``) also ``PAIR_KEYS``."""
OPTIONAL_LAST_STAGE_KEYS = (SAMPLE_WEIGHTS,)
"""Passed on when the batch has them (rows of a sampled store); None otherwise."""


def get_kd_batch(data_iterator, *, is_first_stage: bool, is_last_stage: bool, cp_group=None,
                 pairs: bool = False) -> dict[str, torch.Tensor | None]:
    """This stage's tensors of the next batch (batch-first, as the dataset yields them), on the model's device,
    cut to this rank's S/cp tokens when ``cp_group`` has more than one rank (``slice_kd_batch_for_cp``); ``pairs``:
    cross-tokenizer rows' pair arrays are wanted too (the token-level term).

    Middle pipeline stages consume nothing and get all None (their input arrives from the previous stage).
    """
    keys = FIRST_STAGE_KEYS + LAST_STAGE_KEYS + OPTIONAL_LAST_STAGE_KEYS + (CHUNK_IDS, CHUNK_LOGPROBS) + PAIR_KEYS
    if not (is_first_stage or is_last_stage):
        return dict.fromkeys(keys)
    batch = next(data_iterator)
    cross = CHUNK_IDS in batch
    last_keys = CROSS_TOKENIZER_KEYS + (PAIR_KEYS if pairs else ()) if cross else LAST_STAGE_KEYS
    wanted = (FIRST_STAGE_KEYS if is_first_stage else ()) + (last_keys if is_last_stage else ())
    if cross and cp_group is not None and dist.get_world_size(cp_group) > 1:
        raise ValueError("cross-tokenizer rows with context parallelism: a chunk would be split across CP ranks; "
                         "set model.context_parallel_size=1")
    missing = [key for key in wanted if key not in batch]
    if missing:
        raise ValueError(f"KD batch lacks {missing}: the data iterator must yield TopKCacheDataset rows")
    if is_last_stage and not cross:
        wanted += tuple(key for key in OPTIONAL_LAST_STAGE_KEYS if key in batch)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batch = {key: batch[key].to(device, non_blocking=True) if key in wanted else None for key in keys}
    return slice_kd_batch_for_cp(batch, cp_group)


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


def _kd_output_processor(*, hidden_states, output_layer, output_weight, context,
                         **_) -> KDLossResult | ChunkLossResult:
    """GPTModel ``output_processor``: final hidden states + lm_head shard -> the fused top-K KD loss.

    The weight is ``output_layer``'s (untied, or tied on a last stage without the embedding), whose forward never
    runs, so its pre-hooks (DDP's gather wait) run here; with tied embeddings on the first stage it is the
    embedding's, whose module already ran, and ``output_layer`` owns no parameter for its hooks to wait on. A caller
    that hands only ``output_weight`` (``output_layer=None``) owns the weight's readiness itself.
    """
    if output_layer is not None:
        run_forward_pre_hooks(output_layer)
    weight = output_weight if output_weight is not None else output_layer.weight   # [V/tp, H]
    if CHUNK_IDS in context:
        return chunk_likelihood_loss(hidden_states, weight, **context)
    return topk_kd_loss(hidden_states, weight, **context)


def validate_local_loss(loss: torch.Tensor) -> None:
    """Bridge's NaN/Inf check of one rank's loss before the DP all-reduce (``training/losses.py``): through
    megatron-core's rerun state machine, fatal (with reruns disabled: a RuntimeError naming rank and iteration)."""
    rerun_state_machine = get_rerun_state_machine()
    for rejection_func, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        rerun_state_machine.validate_result(result=loss, rejection_func=rejection_func,
                                            message=f"found {name} in local forward KD loss calculation",
                                            tolerance=0.0, fatal=True)   # the forward is deterministic


def kd_loss_func(alpha: float, output_tensor, *, check_for_nan_in_loss: bool = True, cross_tokenizer: bool = False,
                 token_level: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's 3-tuple loss contract from the loss's result (``lm loss`` reported only when alpha < 1).

    ``output_tensor`` is the ``KDLossResult`` (``ChunkLossResult`` when ``cross_tokenizer``, with the token-level
    term's figures when ``token_level``; or the plain tuple a bf16 ``Float16Module`` turns it into);
    ``check_for_nan_in_loss`` (Bridge's ``rerun_state_machine.check_for_nan_in_loss``) validates the loss sum.
    """
    if cross_tokenizer:
        chunks = ChunkLossResult(*output_tensor)
        if check_for_nan_in_loss:
            validate_local_loss(chunks.loss_sum)
        count = chunks.num_tokens.to(torch.float32)
        report = {"chunk loss": torch.stack([chunks.chunk_sum, count]), "lm loss": torch.stack([chunks.ce_sum, count]),
                  "chunks": torch.stack([chunks.num_chunks.float(), count]),
                  "chunk gap": torch.stack([chunks.chunk_gap_sum, chunks.num_chunks.float()])}
        if token_level:
            report["token kd loss"] = torch.stack([chunks.token_sum, chunks.num_pairs.float()])
            report["pairs"] = torch.stack([chunks.num_pairs.float(), count])
        return chunks.loss_sum, chunks.num_tokens.to(torch.int), report
    result = KDLossResult(*output_tensor)
    if check_for_nan_in_loss:
        validate_local_loss(result.loss_sum)
    count = result.num_tokens.to(torch.float32)
    report = {"kd loss": torch.stack([result.kd_sum, count])}
    if alpha < 1.0:
        report["lm loss"] = torch.stack([result.ce_sum, count])
    report["student top-K mass"] = torch.stack([result.student_topk_mass_sum, count])
    report["teacher top-K mass"] = torch.stack([result.teacher_topk_mass_sum, count])
    return result.loss_sum, result.num_tokens.to(torch.int), report


def check_no_mtp(config) -> None:
    """ValueError for a student with multi-token-prediction heads (``mtp_num_layers``): given labels, GPTModel's MTP
    path (``process_mtp_loss``) builds full [s, b, V] logits through ``output_layer`` and trains the heads on
    hard-label CE, which the KD step neither wants nor pays for."""
    if getattr(config, "mtp_num_layers", None):
        raise ValueError(f"model.mtp_num_layers={config.mtp_num_layers}: the KD step does not train multi-token "
                         "prediction heads (they would build full [s, b, V] logits); set model.mtp_num_layers=None")


def kd_forward_step(state, data_iterator, model, return_schedule_plan: bool = False):
    """Bridge forward step: ``(output, partial(kd_loss_func, alpha))``; reads ``state.cfg.kd`` (a ``KDConfig``)."""
    if return_schedule_plan:
        raise ValueError("kd_forward_step does not build MoE overlap schedule plans "
                         "(set model.overlap_moe_expert_parallel_comm=False)")
    options, token_weight = state.cfg.kd.options(), state.cfg.kd.token_weight
    config = get_model_config(model)
    check_no_mtp(config)
    pg_collection = get_attr_wrapped_model(model, "pg_collection")
    batch = get_kd_batch(data_iterator, is_first_stage=is_pp_first_stage(pg_collection.pp),
                         is_last_stage=is_pp_last_stage(pg_collection.pp), cp_group=pg_collection.cp,
                         pairs=token_weight > 0)
    context = None
    cross = batch[CHUNK_IDS] is not None
    if cross:
        pairs = {} if token_weight == 0 else dict(zip(("teacher_ids", "teacher_logprobs"), (
            t.transpose(0, 1) for t in pair_topk(*(batch[key] for key in PAIR_KEYS))), strict=True))   # [s, b, K]
        context = dict(labels=batch["labels"].t(), chunk_ids=batch[CHUNK_IDS].t(),                  # [s, b]
                       teacher_chunk_logprobs=batch[CHUNK_LOGPROBS].t(), loss_mask=batch["loss_mask"].t(),
                       divergence=options.divergence, jsd_beta=options.jsd_beta, temperature=options.temperature,
                       alpha=options.alpha, chunk_bytes=options.chunk_bytes, kernels=options.kernels,
                       tp_group=pg_collection.tp,
                       sequence_parallel=config.sequence_parallel, token_weight=token_weight, **pairs)
    elif batch["teacher_ids"] is not None:
        context = dict(
            teacher_ids=batch["teacher_ids"].transpose(0, 1),              # [s, b, K]
            teacher_logprobs=batch["teacher_logprobs"].transpose(0, 1),    # [s, b, K]
            loss_mask=batch["loss_mask"].t(),                              # [s, b]
            labels=batch["labels"].t() if options.alpha < 1.0 else None,  # [s, b]
            sample_weights=None if batch[SAMPLE_WEIGHTS] is None else batch[SAMPLE_WEIGHTS].transpose(0, 1),
            tp_group=pg_collection.tp,
            sequence_parallel=config.sequence_parallel,
            **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
        )
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                   attention_mask=_causal_mask_off_cuda(config.seq_length if batch["tokens"] is None
                                                        else batch["tokens"].shape[1]),
                   labels=batch["labels"], output_processor=_kd_output_processor, output_processor_context=context)
    return output, functools.partial(kd_loss_func, options.alpha, cross_tokenizer=cross,
                                     token_level=cross and token_weight > 0,
                                     check_for_nan_in_loss=state.cfg.rerun_state_machine.check_for_nan_in_loss)
