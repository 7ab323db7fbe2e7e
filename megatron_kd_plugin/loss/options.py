"""The KD losses' options, declared once (also Megatron-Bridge's ``cfg.kd``), and the result every KD loss returns."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

TAILS = ("ghost", "none", "renorm", "sampled")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
IMPLS = ("fused", "forward_chunked", "dense")
MODES = ("recompute", "grad_in_forward")
KERNELS = ("auto", "torch", "triton")

DEFAULT_CHUNK_BYTES = {"cpu": 32 * 2**20, "cuda": 512 * 2**20}


@dataclasses.dataclass(kw_only=True)
class KDLossOptions:
    """How a KD loss is computed. The math is in ``megatron_kd_plugin.loss.token_math``.

    The same dataclass is a KD run's ``cfg.kd`` section, which Bridge's overrides (``kd.temperature=2``) set
    attribute by attribute: it is checked when built and again by ``check()`` before step one; each loss call takes
    a copy (``with_overrides``).
    """

    tail: str = "ghost"
    """Treatment of the teacher's mass outside its top-K: ``ghost`` (one extra bucket holding 1 - m for the teacher
    and 1 - s for the student), ``none`` (sparse KL over the K ids against the full-vocab student softmax) or
    ``renorm`` (both distributions renormalised over the K ids; needs only the K rows W[I]); ``sampled``: the slots are
    ids drawn from the teacher with importance weights (a sampled store's rows), an unbiased estimate of the full KL
    (``forward_kl`` at temperature 1 only)."""

    divergence: str = "forward_kl"
    """``forward_kl`` KL(P || Q), ``reverse_kl`` KL(Q || P) or ``jsd`` (generalised Jensen-Shannon, ``jsd_beta``),
    on the tail mode's buckets. ``tail="none"`` supports only ``forward_kl``."""

    jsd_beta: float = 0.5
    """beta of JSD_beta(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q; in (0, 1).
    With ``divergence="jsd"`` only: another value beside another divergence is refused (it would have no effect)."""

    temperature: float = 1.0
    """tau > 0: student logits are divided by tau, teacher log-probs tempered as l / tau and renormalised within the
    tail mode's buckets; the KD term is scaled by tau^2."""

    alpha: float = 1.0
    """Mix: loss = alpha * tau^2 * KD + (1 - alpha) * CE(labels) at tau = 1; in [0, 1]. alpha < 1 needs labels."""

    token_weight: float = 0.0
    """Cross-tokenizer students only (``cross_tokenizer_loss``): gamma in [0, 1], the token-level term's share of the
    teacher's part: the top-K loss at every student position with weight gamma, the ALM segment term with 1 - gamma, each
    token's CE with what alpha leaves of it; 0: the ALM segment term alone, 1: the token-level term alone."""

    impl: str = "fused"
    """``fused`` (the product: X and W in, no [T, V/tp] logits), ``forward_chunked`` (full logits, sparse teacher,
    chunked loss) or ``dense`` (teacher expanded to a [T, V] grid, autograd; a reference)."""

    mode: str = "recompute"
    """Fused only: ``recompute`` (backward recomputes each logits chunk) or ``grad_in_forward`` (the gradients are
    produced during forward and only scaled by the incoming gradient in backward: no recompute, more memory
    held between forward and backward: dX [T, H] and dW [V/tp, H])."""

    kernels: str = "auto"
    """Fused only: who does the per-chunk vocab work (row max / sum-exp, top-K gather, logits gradient).
    ``triton``: the kernels of ``megatron_kd_plugin.kernels`` (chunk GEMMs in the input dtype, e.g. bf16 logits and
    gradient with fp32 accumulation; fp32 math inside the kernels; ValueError if Triton cannot run here or the
    inputs are float64); ``torch``: the PyTorch chunk pieces in the accumulation dtype; ``auto``: Triton when the
    inputs are on CUDA (or on CPU under ``TRITON_INTERPRET=1``), not float64, and triton is importable, else torch.
    The references and the renorm K-rows fast path ignore it."""

    chunk_bytes: int | None = None
    """Byte budget of the per-chunk working buffers ([c, V/tp] fp32 logits/gradient, or [c, K, H] rows in the renorm
    fast path); the chunk size c in tokens is derived from it. None: ``DEFAULT_CHUNK_BYTES`` of the device
    (32 MiB on CPU, where matmuls saturate at a few hundred rows; 512 MiB on CUDA)."""

    validate: bool = True
    """Check the teacher's values (ids in range, finite log-probs <= 0, top-K mass <= 1 + mass_tolerance, labels
    in range) once up front; costs one host sync. Shapes and dtypes are always checked."""

    mass_tolerance: float = 1e-2
    """How far the teacher's top-K mass may exceed 1 (rounding of fp16 log-probs) before it is an error; with
    ``validate`` only (another value beside ``validate=False`` is refused)."""

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """ValueError naming the offending value (run at construction; call it again after setting fields)."""
        for name, allowed in (("tail", TAILS), ("divergence", DIVERGENCES), ("impl", IMPLS), ("mode", MODES),
                              ("kernels", KERNELS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {allowed}")
        if self.tail == "none" and self.divergence != "forward_kl":
            raise ValueError(f"tail='none' supports only divergence='forward_kl', got divergence={self.divergence!r}: "
                             "the teacher's mass outside its top-K is unknown, so the student's side of "
                             "reverse KL / JSD cannot be formed; use tail='ghost' or 'renorm'")
        if self.tail == "sampled" and (self.divergence != "forward_kl" or self.temperature != 1.0):
            raise ValueError(f"tail='sampled' supports only divergence='forward_kl' and temperature=1.0, got "
                             f"divergence={self.divergence!r}, temperature={self.temperature!r}: the importance "
                             "weights estimate the teacher at the cache temperature, and reverse KL / JSD / "
                             "tempering need the teacher's mass where nothing was drawn; use a top-K tail for those")
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"jsd_beta={self.jsd_beta!r}: expected 0 < jsd_beta < 1")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature={self.temperature!r}: expected > 0")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha!r}: expected 0 <= alpha <= 1")
        if not 0.0 <= self.token_weight <= 1.0:
            raise ValueError(f"token_weight={self.token_weight!r}: expected 0 <= token_weight <= 1")
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1):
            raise ValueError(f"chunk_bytes={self.chunk_bytes!r}: expected a positive int or None")
        if not self.mass_tolerance >= 0.0:
            raise ValueError(f"mass_tolerance={self.mass_tolerance!r}: expected >= 0")
        for name, needs, applies in (("jsd_beta", "divergence='jsd'", self.divergence == "jsd"),
                                     ("mass_tolerance", "validate=True", self.validate)):
            default = KDLossOptions.__dataclass_fields__[name].default
            if getattr(self, name) != default and not applies:
                raise ValueError(f"{name}={getattr(self, name)!r} has no effect without {needs}: remove it (the "
                                 f"default is {default!r}) or set {needs}")

    def with_overrides(self, **overrides) -> KDLossOptions:
        """A checked copy with ``overrides`` (field names of this class) applied: what a loss call uses, so that a
        later change of these options never reaches it."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown KD loss option(s) {unknown}; the options are KDLossOptions' fields")
        return dataclasses.replace(self, **overrides)

    def budget_bytes(self, device: torch.device) -> int:
        """The chunk byte budget in effect on ``device``."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return DEFAULT_CHUNK_BYTES["cuda" if device.type == "cuda" else "cpu"]


class KDLossResult(NamedTuple):
    """What every KD loss returns (``topk_kd_loss``, ``cross_tokenizer_loss``), Megatron's loss contract plus the
    figures a training log reports. Sums run over tokens with a non-zero loss_mask, weighted by it.

    It crosses megatron-core's ``output_processor`` hook and a bf16 ``Float16Module`` (which turns it into a plain
    tuple: ``KDLossResult(*output)`` rebuilds it)."""

    loss_sum: torch.Tensor
    """Differentiable fp32 scalar (float64 for float64 inputs): what is optimised, summed over tokens."""
    num_tokens: torch.Tensor
    """int64 scalar: number of tokens with a non-zero loss_mask."""
    report: dict[str, torch.Tensor]
    """Detached ``[sum, count]`` pairs by name, Bridge's report format (logged as sum / count): e.g. ``kd loss``
    (the KD divergence without alpha * tau^2), ``lm loss`` (the hard-label CE at tau = 1, when labels are given),
    ``student top-K mass`` / ``teacher top-K mass``; each loss's docstring lists its own."""

    def sum(self, name: str) -> torch.Tensor:
        """The sum of figure ``name`` (KeyError naming the figures there are)."""
        if name not in self.report:
            raise KeyError(f"{name!r} is not reported; the figures are {sorted(self.report)}")
        return self.report[name][0]


def check_training_options(options: KDLossOptions, *, heal: bool) -> list[str]:
    """Before step one of a training run on a teacher's top-K or draws (``cache.rows.slot_rows.SlotRows.check``):
    combinations measured to leave a student worse than it started (docs/store-kinds-and-loss.md, "The option screen": every tail x
    temperature x divergence x alpha on the heal demo). ValueError for a combination that starves the student whatever
    the learning rate; the warning lines for one that did at the recipe's learning rate (``heal``: the student starts
    from trained weights); [].

    tail="none" with alpha = 1 or tau != 1: nothing holds the student's mass outside the teacher's top-K, and the
    loss drives it to zero (heal demo: held-out perplexity 140 -> 280 at tau 1, 1,036 at tau 2; 227 at alpha 0.5,
    tau 2). 0 < alpha < 1 in a heal: the hard-label term pulled every such heal further from its teacher (KL) than
    the pruned student was, at lr 1e-3; alpha = 1 healed at every setting measured. tail="renorm" at alpha = 1 for a
    student from random weights (not a heal): nothing teaches it the mass outside the top-K (quality bench, alpha 1:
    top-100 renorm perplexity 97.4, top-32 216.5, against CE 78.9 and ghost 53.4 / 55.2).
    """
    if options.tail == "none" and (options.alpha == 1.0 or options.temperature != 1.0):
        raise ValueError(f"kd.tail='none' with kd.alpha={options.alpha}, kd.temperature={options.temperature} drives "
                         "the student's probability outside the teacher's top-K to zero (docs/store-kinds-and-loss.md, the option "
                         "screen); use kd.tail='renorm' or 'ghost'")
    if heal and 0.0 < options.alpha < 1.0:
        return [f"kd.alpha={options.alpha} mixes hard-label cross entropy into a heal: on the heal demo every alpha "
                "< 1 healed less than alpha = 1, and at lr 1e-3 left the student further from its teacher (KL) than "
                "before healing (docs/store-kinds-and-loss.md, the option screen); kd.alpha=1.0 unless you mean it"]
    if not heal and options.tail == "renorm" and options.alpha == 1.0:
        return ["kd.tail='renorm' at kd.alpha=1.0 teaches a student that does not start from trained weights only the "
                "shape inside the teacher's top-K: from random weights it learnt less than hard labels alone (quality "
                "bench, top-100: perplexity 97.4 against CE's 78.9 and the ghost tail's 53.4; docs/store-kinds-and-loss.md); "
                "kd.tail='ghost' unless the student is trained (checkpoint.pretrained_checkpoint)"]
    return []
