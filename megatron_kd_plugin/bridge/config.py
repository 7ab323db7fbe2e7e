"""The KD section of a Megatron-Bridge config: loss options Bridge's overrides can set, and the container holding it.

    cfg = KDConfigContainer(model=..., dataset=TopKCacheDatasetProvider(...), kd=KDConfig(temperature=2.0), ...)
    process_config_with_overrides(cfg, cli_overrides=["kd.alpha=0.5"])   # Bridge's Hydra-style overrides

``KDConfig`` mirrors ``megatron_kd_plugin.loss.KDLossOptions`` field for field (their meanings are documented there,
once), plus ``token_weight``, which only the cross-tokenizer loss reads. It exists because Bridge applies overrides
with ``setattr`` and the loss's options are frozen: a frozen section would silently ignore ``kd.temperature=2``.
``KDConfig.options()`` builds (and so validates) the frozen options the loss receives.
"""

from __future__ import annotations

import dataclasses
import warnings

from megatron.bridge.training.config import ConfigContainer
from megatron.bridge.utils.common_utils import get_world_size_safe

from megatron_kd_plugin.bridge.context_parallel import check_cp_seq_length
from megatron_kd_plugin.bridge.forward_step import check_no_mtp
from megatron_kd_plugin.bridge.provider import TopKCacheDatasetProvider
from megatron_kd_plugin.loss.options import KDLossOptions, check_training_options

_DEFAULTS = KDLossOptions()


@dataclasses.dataclass(kw_only=True)
class KDConfig:
    """Top-K distillation loss options (see ``KDLossOptions`` for each field's meaning)."""

    tail: str = _DEFAULTS.tail
    """``ghost`` | ``none`` | ``renorm``: the teacher's mass outside its top-K; ``sampled``: the store holds drawn ids
    with importance weights (a sampled cache), an unbiased estimate of the full forward KL (needs
    divergence=forward_kl, temperature=1)."""
    divergence: str = _DEFAULTS.divergence
    """``forward_kl`` | ``reverse_kl`` | ``jsd``."""
    jsd_beta: float = _DEFAULTS.jsd_beta
    """beta of JSD_beta, in (0, 1)."""
    temperature: float = _DEFAULTS.temperature
    """tau > 0 (KD term scaled by tau^2)."""
    alpha: float = _DEFAULTS.alpha
    """alpha * tau^2 * KD + (1 - alpha) * CE; alpha < 1 adds the hard-label ``lm loss``."""
    impl: str = _DEFAULTS.impl
    """``fused`` (the product) | ``forward_chunked`` | ``dense`` (reference only: builds [T, V])."""
    mode: str = _DEFAULTS.mode
    """``recompute`` | ``grad_in_forward`` (fused only)."""
    kernels: str = _DEFAULTS.kernels
    """``auto`` | ``torch`` | ``triton``: who does the fused loss's per-chunk vocab work."""
    chunk_bytes: int | None = _DEFAULTS.chunk_bytes
    """Per-chunk working-buffer budget in bytes; None: the loss's default."""
    validate: bool = _DEFAULTS.validate
    """Check the teacher's values up front on every call (one host sync)."""
    mass_tolerance: float = _DEFAULTS.mass_tolerance
    """How far the teacher's top-K mass may exceed 1 before it is an error."""
    token_weight: float = 0.0
    """Cross-tokenizer students only (``dataset.student_tokenizer``): gamma in [0, 1], the token-level term's share of
    the teacher's part (``megatron_kd_plugin.loss.cross_tokenizer``): the top-K loss at the pair tokens with weight
    gamma, the ALM chunk term with 1 - gamma, each token's CE with what alpha leaves of it; 0: the ALM chunk term
    alone, 1: the token-level term alone (the cross-tokenizer recipes' choice)."""

    def options(self) -> KDLossOptions:
        """The frozen, validated options for ``topk_kd_loss`` (raises ValueError on a bad value)."""
        return KDLossOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(KDLossOptions)})

    def finalize(self) -> None:
        """Validate now, before step one."""
        self.options()
        if not 0.0 <= self.token_weight <= 1.0:
            raise ValueError(f"kd.token_weight={self.token_weight!r}: expected 0 <= token_weight <= 1")


@dataclasses.dataclass(kw_only=True)
class KDConfigContainer(ConfigContainer):
    """Bridge's ``ConfigContainer`` plus the ``kd`` section read by ``kd_forward_step``."""

    kd: KDConfig | None = None
    """Top-K distillation loss options; required. (None only when a loader dropped the section, which is refused:
    Bridge's ``ConfigContainer.from_yaml`` keeps only ``ConfigContainer``'s own fields, yet instantiates the
    ``_target_`` class, so a KD YAML would otherwise come back with default loss options.)"""

    def __post_init__(self) -> None:
        if self.kd is None:
            raise ValueError("KDConfigContainer without its kd section: ConfigContainer.from_yaml drops it (lenient "
                             "mode); load a KD config with KDConfigContainer.from_yaml, or pass kd=KDConfig(...)")

    def validate(self) -> None:
        """Bridge's validation, then ``check_kd_config`` (Bridge's ``runtime_config_update`` calls this).

        A NullTokenizer without a vocabulary size (the recipes') takes the model's, whatever ``model.vocab_size``
        overrides set: Bridge's setup refuses a model vocabulary smaller than the tokenizer's.
        """
        if self.tokenizer.tokenizer_type == "NullTokenizer" and self.tokenizer.vocab_size is None:
            self.tokenizer.vocab_size = self.model.vocab_size
        super().validate()
        check_kd_config(self)


def check_kd_config(cfg: ConfigContainer) -> None:
    """What a KD run needs before step one; ValueError naming the offending value.

    The loss options are valid; the model's parallel sizes divide the world; the dataset is a finished top-K cache
    whose K is the expected one, whose vocabulary fits the student's and whose seq_length is a multiple of the student's (= the dataset's), and
    whose mode matches ``kd.tail`` (a sampled store needs tail="sampled", and tail="sampled" a sampled store);
    with context parallelism 2·cp divides seq_length; virtual pipelines and multi-token-prediction heads, which the
    KD step does not handle, are off. A cross-tokenizer student (``dataset.student_tokenizer``) needs a store with the
    cross-tokenizer arrays, its tokenizer inside model.vocab_size, and no context parallelism (the tail/mode check
    does not apply; kd.token_weight > 0 needs a top-K store, and is refused for a same-tokenizer student). Then, for
    a same-tokenizer student, ``check_training_options``: a refusal, or warnings (``UserWarning``, shown before step
    one), for loss options measured to leave a student worse than it started.
    """
    if not isinstance(cfg.dataset, TopKCacheDatasetProvider):
        raise ValueError(f"cfg.dataset is a {type(cfg.dataset).__name__}; a KD run needs a TopKCacheDatasetProvider")
    cfg.kd.finalize()
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
    reader = cfg.dataset.open_validated(vocab_size=model.vocab_size)
    if cfg.dataset.student_table(reader) is not None:             # cross-tokenizer rows: the ALM chunk loss
        if model.context_parallel_size > 1:
            raise ValueError(f"model.context_parallel_size={model.context_parallel_size} with a cross-tokenizer "
                             "student (dataset.student_tokenizer): chunks would be split across CP ranks; use 1")
        if cfg.kd.token_weight > 0 and reader.spec.mode == "sampled":
            raise ValueError(f"kd.token_weight={cfg.kd.token_weight} needs the teacher's top-K, and "
                             f"{cfg.dataset.cache_path} is a sampled store; write it without --sample")
        return
    if cfg.kd.token_weight > 0:
        raise ValueError(f"kd.token_weight={cfg.kd.token_weight} is for cross-tokenizer students: set "
                         "dataset.student_tokenizer to the student's tokenizer, or kd.token_weight=0")
    mode = reader.spec.mode
    if (mode == "sampled") != (cfg.kd.tail == "sampled"):
        raise ValueError(f"kd.tail={cfg.kd.tail!r} does not fit the {mode} store {cfg.dataset.cache_path}: a sampled "
                         "store needs kd.tail='sampled', and kd.tail='sampled' a store written with --sample N")
    for warning in check_training_options(cfg.kd.options(), heal=cfg.checkpoint.pretrained_checkpoint is not None):
        warnings.warn(warning)   # once per process, though the train command checks twice (here, then validate)


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
