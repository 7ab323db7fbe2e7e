"""Edge cases of the loss against float64 dense references (issue 15, items 7-9): a saturated teacher against an
underflowing student tail, teacher tails below float32's resolution, an empty batch, ignore_index labels."""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.loss import TopKTeacher, topk_kd_loss
from tests.test_loss_helpers import (SATURATED_COMBOS, make_case, make_head_draws_case,  # noqa: F401
                                     make_sampled_case, make_saturated_case, make_small_tail_case, one_thread,
                                     rel_err, run_loss, teacher_of)

pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = [dict(impl="dense"), dict(impl="forward_chunked"), dict(impl="fused", mode="recompute", kernels="torch"),
         dict(impl="fused", mode="grad_in_forward", kernels="torch")]


def _float64(case):
    return {key: value.double() if value.is_floating_point() else value for key, value in case.items()}


def _assert_matches(case, options, rtol):
    """Every path on the case's fp32 inputs: finite, and equal to the float64 dense loss and gradients."""
    ref, ref_dh, ref_dw = run_loss(_float64(case), impl="dense", **options)
    assert ref.loss_sum.abs() > 0 and ref_dh.abs().max() > 0, options
    for path in PATHS:
        got, dh, dw = run_loss(case, **options, **path)
        where = (options, path)
        assert torch.isfinite(got.loss_sum) and torch.isfinite(dh).all() and torch.isfinite(dw).all(), where
        assert rel_err(got.loss_sum, ref.loss_sum) < rtol, (where, rel_err(got.loss_sum, ref.loss_sum))
        assert rel_err(dh, ref_dh) < rtol and rel_err(dw, ref_dw) < rtol, (where, rel_err(dh, ref_dh),
                                                                          rel_err(dw, ref_dw))


@pytest.mark.parametrize("tail,divergence", SATURATED_COMBOS)
def test_saturated_teacher_and_underflowing_student_tail(tail, divergence):
    """Teacher top-K mass 1 in fp32, student tail exp(-200 / 1.3) = 0 in fp32: 0 log 0 is 0, not NaN, in every
    path (the renorm K-rows path included: tail='renorm' without labels), loss and gradients equal to float64."""
    _assert_matches(make_saturated_case(), dict(tail=tail, divergence=divergence, temperature=1.3), rtol=1e-5)


def test_saturated_teacher_reproducer():
    """The issue's reproducer, verbatim: 0, not NaN."""
    x, w = torch.zeros(1, 1, 4), torch.eye(4)
    x[0, 0, 0] = 120.0
    assert topk_kd_loss(x, w, TopKTeacher(torch.tensor([[[0]]]), torch.tensor([[[0.0]]])), kernels="torch").loss_sum == 0


def test_reverse_kl_ghost_tail_below_float32_resolution():
    """True teacher tail 1e-8 (m rounds to 1 in fp32): reverse KL with the ghost tail is finite with finite
    gradients, equal to float64 teacher math on the same inputs, in every path."""
    _assert_matches(make_small_tail_case(1e-8), dict(tail="ghost", divergence="reverse_kl"), rtol=1e-5)


@pytest.mark.parametrize("temperature", [2.0, 4.0])
def test_tempered_ghost_tail_below_float32_resolution(temperature):
    """Tail 1e-9, tau = 2 and 4 (tempering amplifies the error of 1 - m): forward KL and JSD equal float64."""
    case = make_small_tail_case(1e-9)
    for divergence in ("forward_kl", "jsd"):
        _assert_matches(case, dict(tail="ghost", divergence=divergence, temperature=temperature), rtol=1e-5)


@pytest.mark.parametrize("validate", [True, False])
def test_empty_sequence_gives_zero_loss_and_zero_grads(validate):
    """s = 0 (an empty microbatch): loss 0, num_tokens 0, zero gradients of the inputs' shapes, in every path."""
    case = make_case(s=1, b=3, vocab=20, k=4, dtype=torch.float32)
    empty = {key: value[:0] for key, value in case.items()}
    empty["weight"] = case["weight"]
    for path in PATHS + [dict(impl="fused", tail="renorm")]:
        with_labels = path.get("tail") != "renorm"
        got, dh, dw = run_loss(empty, validate=validate, with_labels=with_labels,
                               alpha=0.5 if with_labels else 1.0, **path)
        assert got.loss_sum == 0 and got.num_tokens == 0 and got.sum("kd loss") == 0, path
        assert not with_labels or got.sum("lm loss") == 0, path
        assert dh.shape == empty["hidden"].shape and dw.shape == case["weight"].shape and not dw.any(), path


def test_ignore_index_labels_have_no_ce_term():
    """labels = -100 on counted tokens: their CE term is 0, their KD term counts, the same with validate=True and
    False, and equal to a float64 reference built from its parts (KD by the dense path, CE by hand)."""
    case = make_case(s=3, b=7, vocab=40, k=5)
    case["labels"][0, :4] = -100
    case["labels"][2, 1] = -100
    assert (case["loss_mask"][case["labels"] == -100] != 0).sum() >= 3
    alpha, tau = 0.4, 1.7
    kd, kd_dh, kd_dw = run_loss(case, impl="dense", temperature=tau)             # tau^2 KD, alpha = 1
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    logits = hidden @ weight.t()                                                # [s, b, V] float64, tau = 1
    scored = (case["labels"] != -100) & (case["loss_mask"] != 0)
    label_logit = logits.gather(-1, case["labels"].clamp(min=0)[..., None])[..., 0]
    ce = torch.where(scored, case["loss_mask"] * (logits.logsumexp(-1) - label_logit), 0.0).sum()
    ce.backward()
    ref_loss = alpha * kd.loss_sum + (1 - alpha) * ce.detach()
    ref_dh, ref_dw = alpha * kd_dh + (1 - alpha) * hidden.grad, alpha * kd_dw + (1 - alpha) * weight.grad
    for validate in (False, True):
        for path in PATHS:
            got, dh, dw = run_loss(case, temperature=tau, alpha=alpha, with_labels=True, validate=validate,
                                   chunk_bytes=4 * 40 * 8 * 2, **path)
            where = (path, validate)
            assert rel_err(got.loss_sum, ref_loss) < 1e-9 and rel_err(got.sum("lm loss"), ce) < 1e-9, where
            assert rel_err(dh, ref_dh) < 1e-9 and rel_err(dw, ref_dw) < 1e-9, where
            assert int(got.num_tokens) == int((case["loss_mask"] != 0).sum()), where


@pytest.mark.parametrize("temperature", [0.5, 2.0, 4.0])
def test_ghost_tail_is_consistent_at_every_temperature(temperature):
    """A student equal to its teacher (the same full-vocab logits) is the ghost loss's fixed point at every tau:
    loss 0 and zero gradients, for every divergence and path. The tail tempered "like one more token" (rho = 1,
    the rule this replaced) fails it for tau != 1: it pulled such a student away from its teacher."""
    gen = torch.Generator().manual_seed(3)
    s, b, vocab, k = 2, 6, 40, 5
    logits = torch.randn(s, b, vocab, generator=gen, dtype=torch.float64) * 2       # [s, b, V] teacher = student
    logprobs, ids = logits.log_softmax(-1).topk(k, dim=-1)
    case = dict(hidden=logits, weight=torch.eye(vocab, dtype=torch.float64), teacher_ids=ids.to(torch.int32),
                teacher_logprobs=logprobs, loss_mask=torch.ones(s, b, dtype=torch.float64))
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        for path in PATHS:
            got, dh, dw = run_loss(case, tail="ghost", divergence=divergence, temperature=temperature, **path)
            assert abs(float(got.loss_sum)) < 1e-12, (divergence, path, float(got.loss_sum))
            assert dh.abs().max() < 1e-12 and dw.abs().max() < 1e-12, (divergence, path)


@pytest.mark.parametrize("options", [dict(mode="grad_in_forward"), dict(tail="renorm")])
def test_gradients_formed_in_forward_are_handed_over_once(options):
    """A loss whose gradients were formed in forward (grad_in_forward; the renorm rows) gives them to one backward;
    a second backward of the same forward is refused (it would scale buffers already handed over)."""
    case = make_case(s=2, b=5)
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    result = topk_kd_loss(hidden, weight, teacher_of(case), loss_mask=case["loss_mask"], **options)
    result.loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="supports one backward per forward"):
        result.loss_sum.backward()


LOSS_PATHS = PATHS + [dict(impl="fused", tail="renorm")]   # the last: the renorm K-rows path (no labels)


def _loss_of(case, path, **options):
    """run_loss with CE mixed in (alpha 0.5) except on the renorm K-rows path, which takes no labels."""
    with_labels = path.get("tail") != "renorm"
    return run_loss(case, with_labels=with_labels, alpha=0.5 if with_labels else 1.0, **options, **path)


@pytest.mark.parametrize("tail", ["ghost", "none", "renorm"])
def test_masked_out_tokens_count_nothing_whatever_their_teacher_rows(tail):
    """Tokens of loss_mask 0 (prompts, padding, a document's last token: issue 49) add nothing to KD, CE, the
    token count or the gradients, in every path: their teacher rows made all padding (-inf, a store that keeps no
    teacher rows there) and their labels -100 give the loss and gradients of the intact rows."""
    case = make_case(s=3, b=11, vocab=40, k=5)
    masked = case["loss_mask"] == 0
    assert 3 <= masked.sum() < masked.numel()
    blanked = dict(case, teacher_ids=torch.where(masked[..., None], 0, case["teacher_ids"]),
                   teacher_logprobs=torch.where(masked[..., None], -torch.inf, case["teacher_logprobs"]),
                   labels=torch.where(masked, -100, case["labels"]))
    for path in LOSS_PATHS:
        path = dict(path, tail=tail)
        ref, ref_dh, ref_dw = _loss_of(case, path)
        got, dh, dw = _loss_of(blanked, path)
        assert int(got.num_tokens) == int((~masked).sum()) == int(ref.num_tokens), path
        assert rel_err(got.loss_sum, ref.loss_sum) < 1e-12, path
        assert rel_err(dh, ref_dh) < 1e-12 and rel_err(dw, ref_dw) < 1e-12, path
        assert not dh[masked].any(), path   # a masked position's hidden state gets no gradient


@pytest.mark.parametrize("store", ["draws t=1", "draws t=0.7", "draws t=1.5", "head + draws"])
def test_masked_out_tokens_of_a_sampled_store_count_nothing_when_they_hold_padding_slots(store):
    """A sampled or head + draws store holds padding slots (id 0, log-prob -inf) at the tokens of loss mask 0
    (issue 49), and the reader weighs them from those log-probs as from any row (``draw_weights``,
    ``head_draw_weights``; G, the proposal's log-normaliser, stays the teacher's, finite): every weight is finite
    and >= 0, so the loss's value check passes (t < 1 once gave +inf), and the loss, token count and gradients are
    those of the intact rows, in every path."""
    from megatron_kd_plugin.cache.kinds.draws import draw_weights
    from megatron_kd_plugin.cache.kinds.head_draws import head_draw_weights

    shape = dict(s=3, b=11, vocab=40)
    if store == "head + draws":
        case = make_head_draws_case(head=3, draws=6, **shape)
        weigh = lambda logprobs: head_draw_weights(logprobs, 3).double()                       # noqa: E731
    else:
        t = float(store.split("=")[1])
        case = make_sampled_case(draws=6, proposal_temperature=t, k=5, **shape)
        lognorm = torch.randn(case["loss_mask"].shape, generator=torch.Generator().manual_seed(3))
        weigh = lambda logprobs: draw_weights(logprobs, lognorm, t).double()                    # noqa: E731
    masked = case["loss_mask"] == 0
    assert 3 <= masked.sum() < masked.numel()
    padded = torch.where(masked[..., None], -torch.inf, case["teacher_logprobs"])
    weights = weigh(padded)
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    blanked = dict(case, teacher_ids=torch.where(masked[..., None], 0, case["teacher_ids"]), teacher_logprobs=padded,
                   draw_weights=torch.where(masked[..., None], weights, case["draw_weights"]),
                   labels=torch.where(masked, -100, case["labels"]))
    for path in PATHS:
        path = dict(path, tail="sampled")
        ref, ref_dh, ref_dw = _loss_of(case, path)
        got, dh, dw = _loss_of(blanked, path)
        assert int(got.num_tokens) == int((~masked).sum()) == int(ref.num_tokens), path
        assert rel_err(got.loss_sum, ref.loss_sum) < 1e-12, path
        assert rel_err(dh, ref_dh) < 1e-12 and rel_err(dw, ref_dw) < 1e-12, path
        assert not dh[masked].any(), path


def test_a_batch_whose_loss_mask_is_all_zero_gives_zero_loss_not_nan():
    """A microbatch with no counted token (one DP rank's share of prompt-only rows): loss 0, num_tokens 0, every
    report pair [0, 0] (a log leaves out figures of no tokens) and zero gradients, in every path; megatron-core then
    divides by max(num_tokens, 1) (``forward_step_calc_loss``; over DP in ``finalize_model_grads``), so 0, not NaN."""
    case = make_case(s=2, b=5, vocab=30, k=4, dtype=torch.float32)
    case["loss_mask"] = torch.zeros_like(case["loss_mask"])
    for path in LOSS_PATHS:
        got, dh, dw = _loss_of(case, path)
        assert got.loss_sum == 0 and got.num_tokens == 0, path
        assert all(pair[1] == 0 for pair in got.report.values()), path
        assert all(pair[0] == 0 for name, pair in got.report.items() if name != "student top-K mass"), path
        assert not dh.any() and not dw.any(), path
