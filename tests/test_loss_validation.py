"""Bad input to the loss gets a ValueError that names the problem."""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.loss import KDLossOptions, topk_kd_loss
from tests.test_loss_helpers import make_case, one_thread, teacher_of  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _call(case, **options):
    return topk_kd_loss(case["hidden"], case["weight"], teacher_of(case),
                        loss_mask=case["loss_mask"], **options)


def _case():
    return make_case(s=2, b=3, vocab=20, k=4, dtype=torch.float32)


def _with(key, fn):
    case = _case()
    case[key] = fn(case[key].clone())
    return case


def _set(index, value):
    def fn(t):
        t[index] = value
        return t
    return fn


BAD_VALUES = [
    ("teacher_ids", _set((0, 0, 0), 20), r"teacher_ids must lie in \[0, V=20\), got min \d+ max 20"),
    ("teacher_ids", _set((1, 2, 3), -1), r"teacher_ids must lie in \[0, V=20\), got min -1"),
    ("teacher_logprobs", _set((0, 1, 2), torch.nan), r"1 NaN"),
    ("teacher_logprobs", _set((0, 1, 2), torch.inf), r"1 \+inf"),
    ("teacher_logprobs", _set((0, 1, 2), 0.5), r"must be <= 0 .* got max 0.5"),
    ("teacher_logprobs", lambda t: t - t.logsumexp(-1, keepdim=True) + 0.05, r"top-K mass .* > 1 \+ mass_tolerance"),
]


@pytest.mark.parametrize("key,corrupt,message", BAD_VALUES)
def test_bad_teacher_values(key, corrupt, message):
    with pytest.raises(ValueError, match=message):
        _call(_with(key, corrupt))


def test_validate_false_skips_value_checks_only():
    case = _with("teacher_logprobs", lambda t: t - t.logsumexp(-1, keepdim=True) + 0.05)
    _call(case, validate=False)                                  # no sync, no error
    with pytest.raises(ValueError, match="teacher_ids must be an integer"):
        _call(_with("teacher_ids", lambda t: t.float()), validate=False)


def test_padding_and_small_rounding_are_accepted():
    case = _with("teacher_logprobs", _set((0, 0, 3), -torch.inf))
    _call(case)
    _call(_with("teacher_logprobs", lambda t: t - t.logsumexp(-1, keepdim=True) + 0.005))   # mass <= 1 + 1e-2


BAD_SHAPES = [
    ("hidden", lambda t: t[0], r"hidden must be a float \[s, b, H\]"),
    ("hidden", lambda t: t.long(), r"hidden must be a float"),
    ("weight", lambda t: t[:, :-1], r"weight must be \[V/tp, H=31\]"),
    ("weight", lambda t: t.double(), r"of hidden's dtype torch.float32"),
    ("teacher_ids", lambda t: t[:1], r"teacher_ids must be an integer \[s=2, b=3, K\]"),
    ("teacher_ids", lambda t: t.float(), r"teacher_ids must be an integer"),
    ("teacher_logprobs", lambda t: t[..., :2], r"teacher_logprobs must be a float tensor shaped like"),
    ("teacher_logprobs", lambda t: t.long(), r"teacher_logprobs must be a float tensor"),
    ("loss_mask", lambda t: t[:1], r"loss_mask must be \[s, b\]"),
]


@pytest.mark.parametrize("key,corrupt,message", BAD_SHAPES)
def test_bad_shapes_and_dtypes(key, corrupt, message):
    with pytest.raises(ValueError, match=message):
        _call(_with(key, corrupt))


def test_labels():
    case = _case()
    with pytest.raises(ValueError, match="alpha=0.5 < 1 mixes in cross entropy: pass labels"):
        _call(case, alpha=0.5)
    with pytest.raises(ValueError, match=r"labels must be an integer \[s, b\]"):
        _call(case, alpha=0.5, labels=case["labels"][:1])
    bad = case["labels"].clone()
    bad[0, 0] = 20
    case["loss_mask"][0, 0] = 1.0
    with pytest.raises(ValueError, match=r"labels of counted tokens must lie in \[0, V=20\)"):
        _call(case, alpha=0.5, labels=bad)
    case["loss_mask"][0, 0] = 0.0                                 # an ignored token's label is not checked
    _call(case, alpha=0.5, labels=bad)


@pytest.mark.parametrize("options,message", [
    (dict(tail="none", divergence="reverse_kl"), "tail='none' supports only divergence='forward_kl'"),
    (dict(tail="none", divergence="jsd"), "tail='none' supports only divergence='forward_kl'"),
    (dict(tail="zero"), "tail='zero': expected one of"),
    (dict(divergence="kl"), "divergence='kl': expected one of"),
    (dict(impl="triton"), "impl='triton': expected one of"),
    (dict(mode="lazy"), "mode='lazy': expected one of"),
    (dict(kernels="cuda"), "kernels='cuda': expected one of"),
    (dict(temperature=0.0), "temperature=0.0: expected > 0"),
    (dict(alpha=1.5), "alpha=1.5: expected 0 <= alpha <= 1"),
    (dict(jsd_beta=1.0), "jsd_beta=1.0: expected 0 < jsd_beta < 1"),
    (dict(chunk_bytes=0), "chunk_bytes=0: expected a positive int or None"),
    (dict(tail="sampled", divergence="jsd"), r"tail='sampled' supports only divergence='forward_kl' and temperature"),
    (dict(tail="sampled", temperature=2.0), r"tail='sampled' supports only .* temperature=2.0: the importance"),
])
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        KDLossOptions(**options)
    with pytest.raises(ValueError, match=message):
        _call(_case(), **options)


def _sampled_case():
    case = _case()
    case["draw_weights"] = torch.full(case["teacher_ids"].shape, 0.25)
    return case


def _without_weights(case):
    return {key: value for key, value in case.items() if key != "draw_weights"}


@pytest.mark.parametrize("tail,corrupt,message", [
    ("sampled", _without_weights, r"kd.tail='sampled' does not fit a TopKTeacher: its slots are a top-K"),
    ("ghost", lambda case: case, r"kd.tail='ghost' does not fit a SampledTeacher: its slots are draws"),
    ("sampled", lambda case: dict(case, draw_weights=case["draw_weights"][..., :2]),
     r"the slots' weights must be a float tensor shaped like their ids \(2, 3, 4\)"),
    ("sampled", lambda case: dict(case, draw_weights=case["draw_weights"].long()),
     r"the slots' weights must be a float tensor .* torch.int64"),
    ("sampled", lambda case: dict(case, draw_weights=_set((0, 1, 2), -0.5)(case["draw_weights"].clone())),
     r"the slots' weights must be finite and >= 0 .* 0 NaN/inf entries and min -0.5"),
    ("sampled", lambda case: dict(case, draw_weights=_set((1, 1, 1), torch.nan)(case["draw_weights"].clone())),
     r"the slots' weights must be finite and >= 0 .* 1 NaN/inf entries"),
])
def test_bad_draw_weights(tail, corrupt, message):
    with pytest.raises(ValueError, match=message):
        _call(corrupt(_sampled_case()), tail=tail)


def test_sampled_mass_counts_each_drawn_id_once():
    """Four draws of one id with p = 0.9: the distinct drawn mass is 0.9 (accepted and reported once), while as
    top-K slots the same log-probs sum to 3.6 (an error)."""
    case = _sampled_case()
    case["teacher_ids"][:] = 5
    case["teacher_logprobs"][:] = torch.tensor(0.9).log()
    result = _call(case, tail="sampled")
    assert abs(float(result.sum("teacher top-K mass")) - 0.9 * int(result.num_tokens)) < 1e-5
    with pytest.raises(ValueError, match=r"top-K mass sum_k exp\(logprob\) is 3\.(6|59)"):
        _call(_without_weights(case))
