"""A KD run's Megatron-Bridge config: Bridge's ``ConfigContainer`` plus the ``kd`` section, the loss's own options.

    cfg = KDConfigContainer(model=..., dataset=TopKCacheDatasetProvider(...), kd=KDLossOptions(temperature=2.0), ...)
    process_config_with_overrides(cfg, cli_overrides=["kd.alpha=0.5"])   # Bridge's Hydra-style overrides

``cfg.kd`` is a ``megatron_kd_plugin.loss.KDLossOptions`` (its fields are documented there, once); Bridge's overrides
set its fields one by one, so it is checked again, with the store and the model, before step one
(``check_kd_config``).
"""

from __future__ import annotations

import dataclasses
import warnings

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.utils.common_utils import get_world_size_safe

from megatron_kd_plugin.bridge.context_parallel import check_cp_seq_length
from megatron_kd_plugin.bridge.forward_step import check_no_mtp
from megatron_kd_plugin.bridge.provider import TopKCacheDatasetProvider
from megatron_kd_plugin.loss import KDLossOptions
from megatron_kd_plugin.models.hf import check_expert_parallel


@dataclasses.dataclass(kw_only=True)
class KDConfigContainer(ConfigContainer):
    """Bridge's ``ConfigContainer`` plus the ``kd`` section read by ``kd_forward_step``."""

    kd: KDLossOptions | None = None
    """The KD loss's options; required. (None only when a loader dropped the section, which is refused:
    Bridge's ``ConfigContainer.from_yaml`` keeps only ``ConfigContainer``'s own fields, yet instantiates the
    ``_target_`` class, so a KD YAML would otherwise come back with default loss options.)"""

    def __post_init__(self) -> None:
        if self.kd is None:
            raise ValueError("KDConfigContainer without its kd section: ConfigContainer.from_yaml drops it (lenient "
                             "mode); load a KD config with KDConfigContainer.from_yaml, or pass kd=KDLossOptions(...)")

    def validate(self) -> None:
        """Bridge's validation, then ``check_kd_config`` (Bridge's ``runtime_config_update`` calls this).

        A NullTokenizer without a vocabulary size (the recipes') takes the model's, whatever ``model.vocab_size``
        overrides set: Bridge's setup refuses a model vocabulary smaller than the tokenizer's.
        """
        if self.tokenizer.tokenizer_type == "NullTokenizer" and self.tokenizer.vocab_size is None:
            self.tokenizer.vocab_size = self.model.vocab_size
        if isinstance(self.dataset, TopKCacheDatasetProvider):
            share_micro_batch_sizes(self)
        super().validate()
        check_kd_config(self)


def share_micro_batch_sizes(cfg: ConfigContainer) -> None:
    """Copies the micro-batch sizes Bridge's samplers deal rows by into the dataset (``dataset.micro_batch_size``,
    ``dataset.eval_micro_batch_size``, replacing any value there): each rank's read-ahead fetches its own rows."""
    cfg.dataset.micro_batch_size = cfg.train.micro_batch_size
    cfg.dataset.eval_micro_batch_size = cfg.validation.eval_micro_batch_size or cfg.train.micro_batch_size


def check_kd_config(cfg: ConfigContainer) -> None:
    """What a KD run needs before step one; ValueError naming the offending value.

    The loss options are valid; the model's parallel sizes divide the world, and a MoE student's expert sizes are
    ones megatron-core builds (``models.hf.check_expert_parallel``: expert TP 1 where the experts have biases, the
    experts' grid dividing the world); every store of the dataset is a
    finished cache whose rows fit the student (``TopKCacheDatasetProvider.row_kinds``: K, vocabulary, seq_length a
    multiple of the student's, which is the dataset's, and equal to it for a store of packed or per-document rows,
    which are read whole; the stores of a blend or ensemble together) and the loss
    options and parallelism (``RowKind.check``: e.g. a sampled store needs kd.tail='sampled', a cross-tokenizer
    student no context parallelism; options measured to leave a healed student worse than it started are refused, or
    warned about before step one: ``loss.options.check_training_options``); with context parallelism 2·cp divides
    seq_length; virtual pipelines and multi-token-prediction heads, which the KD step does not handle, are off; rows
    of several documents come without context or pipeline parallelism (``check_document_parallelism``).
    """
    if not isinstance(cfg.dataset, TopKCacheDatasetProvider):
        raise ValueError(f"cfg.dataset is a {type(cfg.dataset).__name__}; a KD run needs a TopKCacheDatasetProvider")
    if not isinstance(cfg.kd, KDLossOptions):
        raise ValueError(f"cfg.kd is a {type(cfg.kd).__name__}; a KD run needs megatron_kd_plugin.loss.KDLossOptions")
    cfg.kd.check()
    model = cfg.model
    if model.seq_length != cfg.dataset.seq_length:
        raise ValueError(f"model.seq_length={model.seq_length} != dataset.seq_length={cfg.dataset.seq_length}: "
                         "override both")
    check_cp_seq_length(model.seq_length, model.context_parallel_size, what="model.seq_length")
    if (model.virtual_pipeline_model_parallel_size or 1) != 1:
        raise ValueError(f"model.virtual_pipeline_model_parallel_size={model.virtual_pipeline_model_parallel_size}:"
                         " the KD step supports only None")
    check_no_mtp(model)
    check_parallel_sizes_divide_world(model)
    check_expert_parallel(model, get_world_size_safe())   # megatron-core would assert it when the model is set up
    heal = cfg.checkpoint.pretrained_checkpoint is not None
    kinds = cfg.dataset.row_kinds(vocab_size=model.vocab_size)
    check_document_parallelism(model, [str(source) for source, kind in kinds.items() if kind.documents])
    warned = {}                                          # each warning once, however many stores give it
    for kind in kinds.values():
        warned.update(dict.fromkeys(kind.check(cfg.kd, context_parallel_size=model.context_parallel_size, heal=heal)))
    for warning in warned:
        warnings.warn(warning)   # before step one (the train command checks twice: once here, once in validate)


def check_document_parallelism(model, stores: list[str]) -> None:
    """ValueError (one line naming the setting and the store) when ``stores``, the run's stores whose rows may hold
    several documents (layout ``packed`` or ``document``), meet context parallelism (megatron-core's load-balanced
    split would cut documents) or pipeline parallelism (the KD step hands only a one-stage model each document's
    attention: ``forward_step.row_attention``)."""
    for name in ("context_parallel_size", "pipeline_model_parallel_size"):
        size = getattr(model, name)
        if stores and size > 1:
            raise ValueError(f"model.{name}={size} with {stores[0]}, whose rows hold several documents (layout packed "
                             "or document): the KD step trains them with no context or pipeline parallelism; use 1, "
                             "or a store cached with --layout stream")


def check_parallel_sizes_divide_world(model) -> None:
    """ValueError unless TP x PP x CP divides the world size (torchrun's WORLD_SIZE, or the process group's)."""
    world = get_world_size_safe()
    sizes = {"tensor_model_parallel_size": model.tensor_model_parallel_size,
             "pipeline_model_parallel_size": model.pipeline_model_parallel_size,
             "context_parallel_size": model.context_parallel_size}
    product = 1
    for size in sizes.values():
        product *= size
    if world % product:
        named = " x ".join(f"model.{name}={value}" for name, value in sizes.items())
        raise ValueError(f"{named} = {product} does not divide the world size {world}")
