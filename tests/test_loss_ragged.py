"""Ragged teacher rows (a top-p store's: padding slots id 0 / log-prob -inf, 1 to K real slots per token) through
every formulation, tail and divergence, against a float64 reference written here from the definitions, with
gradients; the same at TP=2 is in tests/test_cache_top_p.py, on the Triton kernels in tests/loss_triton_checks.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_loss_helpers import (COMBOS, combo, make_ragged_case, one_thread, rel_err, run_loss,  # noqa: F401
                                     token_kd_from_definition)

pytestmark = pytest.mark.usefixtures("one_thread")

FORMULATIONS = [dict(impl="dense"), dict(impl="forward_chunked"), dict(impl="fused", mode="recompute"),
                dict(impl="fused", mode="grad_in_forward")]
OPTIONS = [dict(temperature=1.0, alpha=1.0), dict(temperature=1.7, alpha=0.4, with_labels=True, jsd_beta=0.3)]


def reference(case, *, tail, divergence, temperature=1.0, alpha=1.0, jsd_beta=0.5, with_labels=False,
              weight=None):
    """(loss_sum, d hidden, d weight, student mass sum) in float64 by autograd over the per-token definitions."""
    hidden = case["hidden"].detach().double().clone().requires_grad_()
    weight = (case["weight"] if weight is None else weight).detach().double().clone().requires_grad_()
    z = hidden @ weight.t()                                    # [s, b, V]
    total, mass = z.new_zeros(()), 0.0
    s, b = case["loss_mask"].shape
    for i in range(s):
        for j in range(b):
            w = float(case["loss_mask"][i, j])
            if w == 0:
                continue
            kd, student_mass = token_kd_from_definition(z[i, j], case["teacher_ids"][i, j], case["teacher_logprobs"][i, j], tail,
                                         divergence, temperature, jsd_beta)
            ce = -torch.log_softmax(z[i, j], -1)[case["labels"][i, j]] if with_labels else 0.0
            total = total + w * (alpha * temperature ** 2 * kd + (1 - alpha) * ce)
            mass += float(student_mass)
    total.backward()
    return total.detach(), hidden.grad, weight.grad, mass


def ragged_errors(case, formulations, options_list, **loss_kwargs):
    """{(tail, divergence, options index, formulation index): worst relative error of loss, dX, dW and the student
    mass on the support (where the formulation reports it)}."""
    errors = {}
    for tail, divergence in COMBOS:
        for o, options in enumerate(options_list):
            options = combo(options, tail=tail, divergence=divergence)
            ref, ref_dh, ref_dw, ref_mass = reference(case, **options)
            assert ref.abs() > 0 and ref_dh.abs().max() > 0, options
            for f, formulation in enumerate(formulations):
                got, dh, dw = run_loss(case, **options, **formulation, **loss_kwargs)
                mass = float(got.sum("student top-K mass"))
                errors[tail, divergence, o, f] = max(rel_err(got.loss_sum, ref), rel_err(dh, ref_dh),
                                                     rel_err(dw, ref_dw),
                                                     0.0 if math.isnan(mass) else abs(mass / ref_mass - 1))
    return errors


def test_ragged_rows_match_the_float64_definitions():
    """3 x 5 tokens, kept counts 1..8 of K = 8, a kept id 0 beside the padding's id 0, a fully masked sequence;
    every tail x divergence, tau 1 and 1.7 with the CE mix, dense / forward-chunked / fused (both modes; renorm
    without labels: the K-rows path), chunks of 4 tokens; rtol 1e-9."""
    case = make_ragged_case()
    kept = (case["teacher_logprobs"] > -torch.inf).sum(-1)
    assert set(kept.flatten().tolist()) == set(range(1, 9))
    assert ((case["teacher_ids"] == 0) & (case["teacher_logprobs"] > -torch.inf)).any()
    errors = ragged_errors(case, FORMULATIONS, OPTIONS, chunk_bytes=4 * 37 * 8 * 2, kernels="torch")
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-9, (worst, errors[worst])


def test_ragged_rows_teacher_mass_and_reader_rows():
    """The reported teacher mass counts only the real slots (a kept id 0 once, not the padding)."""
    case = make_ragged_case()
    got, _, _ = run_loss(case, tail="ghost")
    probs = torch.where(case["teacher_logprobs"] > -torch.inf, case["teacher_logprobs"].exp(), 0.0)
    expected = (probs.sum(-1) * (case["loss_mask"] != 0)).sum()
    assert rel_err(got.sum("teacher top-K mass"), expected) < 1e-12
