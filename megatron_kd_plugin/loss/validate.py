"""Input checks, done once up front: shapes and dtypes always (no sync), values when asked (one host sync)."""

from __future__ import annotations

import torch

from .options import KDLossOptions
from .loss_plan import IGNORE_INDEX
from .teacher import SlotTeacher
from .tp import VocabShard


def _is_int(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def check_shapes(hidden: torch.Tensor, weight: torch.Tensor, teacher: SlotTeacher,
                 loss_mask: torch.Tensor | None, labels: torch.Tensor | None, options: KDLossOptions,
                 shard: VocabShard, sequence_parallel: bool) -> None:
    """Raise ValueError naming the offending shape or dtype."""
    if hidden.dim() != 3 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be a float [s, b, H] tensor, got {tuple(hidden.shape)} {hidden.dtype}")
    if weight.dim() != 2 or weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"weight must be [V/tp, H={hidden.shape[2]}] of hidden's dtype {hidden.dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    seq = hidden.shape[0] * (shard.size if sequence_parallel else 1)
    tokens = (seq, hidden.shape[1])
    if not callable(getattr(teacher, "buckets", None)):
        raise ValueError(f"teacher must be a SlotTeacher (K slots per token), got {type(teacher).__name__}")
    teacher_ids, teacher_logprobs, slot_weights = teacher.ids, teacher.logprobs, teacher.weights
    if teacher_ids.dim() != 3 or tuple(teacher_ids.shape[:2]) != tokens or not _is_int(teacher_ids):
        raise ValueError(f"teacher_ids must be an integer [s={seq}, b={hidden.shape[1]}, K] tensor, "
                         f"got {tuple(teacher_ids.shape)} {teacher_ids.dtype}")
    if teacher_ids.shape[2] < 1:
        raise ValueError(f"teacher_ids has K={teacher_ids.shape[2]}; need K >= 1")
    if teacher_logprobs.shape != teacher_ids.shape or not teacher_logprobs.dtype.is_floating_point:
        raise ValueError(f"teacher_logprobs must be a float tensor shaped like teacher_ids {tuple(teacher_ids.shape)},"
                         f" got {tuple(teacher_logprobs.shape)} {teacher_logprobs.dtype}")
    teacher.check_tail(options.tail)
    if slot_weights is not None and (slot_weights.shape != teacher_ids.shape
                                     or not slot_weights.dtype.is_floating_point):
        raise ValueError(f"the slots' weights must be a float tensor shaped like their ids {tuple(teacher_ids.shape)}, "
                         f"got {tuple(slot_weights.shape)} {slot_weights.dtype}")
    if loss_mask is not None and tuple(loss_mask.shape) != tokens:
        raise ValueError(f"loss_mask must be [s, b] = {tokens}, got {tuple(loss_mask.shape)}")
    if labels is None and options.alpha < 1.0:
        raise ValueError(f"alpha={options.alpha} < 1 mixes in cross entropy: pass labels")
    if labels is not None and (tuple(labels.shape) != tokens or not _is_int(labels)):
        raise ValueError(f"labels must be an integer [s, b] = {tokens} tensor, got {tuple(labels.shape)} "
                         f"{labels.dtype}")
    devices = {t.device for t in (hidden, weight, *teacher, loss_mask, labels) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def check_groups(groups: torch.Tensor | None, group_names: tuple[str, ...], tokens: tuple[int, ...]) -> None:
    """ValueError unless report groups are an integer [s, b] tensor with at least one name, or absent."""
    if groups is None:
        if group_names:
            raise ValueError(f"group_names={tuple(group_names)} without groups: pass each token's group [s, b]")
        return
    if not group_names:
        raise ValueError("groups without group_names: name each report group")
    if tuple(groups.shape) != tuple(tokens) or not _is_int(groups):
        raise ValueError(f"groups must be an integer [s, b] = {tuple(tokens)} tensor, got {tuple(groups.shape)} "
                         f"{groups.dtype}")


def check_values(teacher: SlotTeacher, loss_mask: torch.Tensor, labels: torch.Tensor | None,
                 options: KDLossOptions, vocab_size: int, groups: torch.Tensor | None = None,
                 num_groups: int = 0) -> None:
    """Raise ValueError for ids outside [0, V), NaN/+inf or positive log-probs (-inf is padding: probability 0),
    the teacher's mass (``SlotTeacher.mass``) above 1 + mass_tolerance, labels outside [0, V) on counted tokens
    (IGNORE_INDEX = -100 is allowed: no CE term), slot weights that are not finite and >= 0, or report groups
    outside [0, num_groups). One host sync; none for an empty batch (s = 0 or b = 0: nothing to check, the loss
    is 0)."""
    teacher_ids, slot_weights = teacher.ids, teacher.weights
    if teacher_ids.numel() == 0:
        return
    logprobs = teacher.logprobs.double()
    finite = torch.where(logprobs.isfinite(), logprobs, logprobs.new_tensor(-torch.inf))
    counted = loss_mask != 0
    label_range = [0.0, 0.0]
    if labels is not None:
        scored = counted & (labels != IGNORE_INDEX)
        label_range = [torch.where(scored, labels, 0).min(), torch.where(scored, labels, 0).max()]
    weight_stats = [logprobs.new_zeros(())] * 2                              # [non-finite count, min]
    if slot_weights is not None:
        weight_stats = [(~slot_weights.isfinite()).sum().double(), slot_weights.double().min()]
    group_range = [0.0, 0.0] if groups is None else [groups.min(), groups.max()]
    stats = torch.stack([teacher_ids.min().double(), teacher_ids.max().double(),
                         logprobs.isnan().sum().double(), (logprobs == torch.inf).sum().double(),
                         finite.max(), teacher.mass().max(),
                         *(torch.as_tensor(v, dtype=torch.float64, device=logprobs.device)
                           for v in (*label_range, *group_range)), *weight_stats])
    (id_min, id_max, nans, pos_inf, lp_max, mass_max, label_min, label_max, group_min, group_max, bad_weights,
     weight_min) = stats.tolist()
    if groups is not None and (group_min < 0 or group_max >= num_groups):
        raise ValueError(f"groups must lie in [0, {num_groups}) (one per group name), got min {int(group_min)} max "
                         f"{int(group_max)}")
    if id_min < 0 or id_max >= vocab_size:
        raise ValueError(f"teacher_ids must lie in [0, V={vocab_size}), got min {int(id_min)} max {int(id_max)}")
    if nans or pos_inf:
        raise ValueError(f"teacher_logprobs has {int(nans)} NaN and {int(pos_inf)} +inf entries")
    if bad_weights or weight_min < 0:
        raise ValueError(f"the slots' weights must be finite and >= 0 (importance weights), got {int(bad_weights)} "
                         f"NaN/inf entries and min {weight_min}")
    if lp_max > 0:
        raise ValueError(f"teacher_logprobs must be <= 0 (log-probabilities), got max {lp_max}")
    if mass_max > 1.0 + options.mass_tolerance:
        raise ValueError(f"teacher top-K mass sum_k exp(logprob) is {mass_max} > 1 + mass_tolerance="
                         f"{options.mass_tolerance}: the log-probs are not normalised over the full vocab")
    if labels is not None and (label_min < 0 or label_max >= vocab_size):
        raise ValueError(f"labels of counted tokens must lie in [0, V={vocab_size}) or be {IGNORE_INDEX} (no CE "
                         f"term), got min {int(label_min)} max {int(label_max)}")
