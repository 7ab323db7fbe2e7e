"""tail="sampled": the dense reference against the definition, and the loss as an unbiased estimate of the full KL.

Unbiasedness: a student with W = I (so hidden = logits z and d hidden = d loss / d z per token) against a full
teacher p over V = 64; each token is repeated over n seeds, each seed draws its own N = 8 ids from the proposal
q' ∝ p^(1/t) with importance weights w = p / (N q'). The exact full-KL gradient q - p (autograd of the dense KL
over the whole vocab, float64) must lie within 5 standard errors of the mean sampled gradient in every component,
and the error must shrink as 1/sqrt(n). A negative control (self-normalised weights w / sum w, biased at t != 1)
must fail the same check.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kd_plugin.loss import SampledTeacher, topk_kd_loss
from tests.test_loss_helpers import draw_from_teacher, make_sampled_case, one_thread, rel_err, run_loss  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS, VOCAB, DRAWS = 4, 64, 8
GROUPS, GROUP_SEEDS = 16, 1024             # n = 16384 seeds in groups (one loss call each)
Z_MAX = 5.0                                # standard errors allowed per component (256 of them)


def _student_and_teacher():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=gen, dtype=torch.float64)
    teacher = torch.randn(TOKENS, VOCAB, generator=gen, dtype=torch.float64).log_softmax(-1)   # [S, V] log p
    z = logits.clone().requires_grad_()
    kl = (teacher.exp() * (teacher - z.log_softmax(-1))).sum()               # the full KL, summed over tokens
    exact_grad, = torch.autograd.grad(kl, z)
    return logits, teacher, float(kl.detach()), exact_grad


def _sampled_estimates(proposal_temperature, self_normalised=False):
    """(d loss / d z per seed [S, n, V], per-group mean KD value [GROUPS]) over GROUPS calls of GROUP_SEEDS seeds."""
    logits, teacher, _, _ = _student_and_teacher()
    gen = torch.Generator().manual_seed(1)
    grads, values = [], []
    for _ in range(GROUPS):
        ids, logprobs, weights = draw_from_teacher(teacher[:, None].expand(TOKENS, GROUP_SEEDS, VOCAB), DRAWS,
                                                   proposal_temperature, gen)
        if self_normalised:
            weights = weights / weights.sum(-1, keepdim=True)
        hidden = logits[:, None].expand(TOKENS, GROUP_SEEDS, VOCAB).clone().requires_grad_()   # [S, n, V]
        result = topk_kd_loss(hidden, torch.eye(VOCAB, dtype=torch.float64), SampledTeacher(ids, logprobs, weights),
                              tail="sampled")
        result.loss_sum.backward()
        grads.append(hidden.grad)
        values.append(float(result.sum("kd loss")) / GROUP_SEEDS)
    return torch.cat(grads, 1), torch.tensor(values, dtype=torch.float64)


def _z_scores(grads, exact_grad):
    """|mean - exact| / (std / sqrt(n)) per component [S, V]."""
    n = grads.shape[1]
    return (grads.mean(1) - exact_grad).abs() / (grads.std(1) / math.sqrt(n))


def _rms_error(grads, exact_grad, seeds):
    """RMS over components and disjoint groups of ``seeds`` seeds of (group mean - exact)."""
    means = grads.reshape(TOKENS, -1, seeds, VOCAB).mean(2)                    # [S, groups, V]
    return float((means - exact_grad[:, None]).pow(2).mean().sqrt())


@pytest.mark.parametrize("proposal_temperature", [1.0, 1.5])
def test_gradient_and_value_are_unbiased(proposal_temperature):
    """Mean over 16384 seeds of the sampled gradient = the full-KL gradient within 5 standard errors per
    component; the RMS error over groups of 64 seeds is ~4x that over groups of 1024 (1/sqrt(n)); the mean KD value
    = the full KL within 5 standard errors."""
    _, _, kl, exact_grad = _student_and_teacher()
    grads, values = _sampled_estimates(proposal_temperature)
    assert (grads.std(1) > 0).all()                                            # every component was drawn
    assert float(_z_scores(grads, exact_grad).max()) < Z_MAX
    ratio = _rms_error(grads, exact_grad, 64) / _rms_error(grads, exact_grad, 1024)
    assert 3.4 < ratio < 4.7, ratio                                            # sqrt(1024 / 64) = 4
    assert abs(float(values.mean()) - kl) < Z_MAX * float(values.std()) / math.sqrt(GROUPS), (values.mean(), kl)


def test_self_normalised_weights_are_detected_as_biased():
    """Negative control: w / sum w at t = 1.5 (a biased estimator) fails the same per-component check and the value
    check, with the same seeds and n."""
    _, _, kl, exact_grad = _student_and_teacher()
    grads, values = _sampled_estimates(1.5, self_normalised=True)
    assert float(_z_scores(grads, exact_grad).max()) > 2 * Z_MAX
    assert abs(float(values.mean()) - kl) > 2 * Z_MAX * float(values.std()) / math.sqrt(GROUPS)


def test_dense_reference_matches_definition():
    """The dense reference, token by token, against f = sum_k w_k (l_k - log q_{I_k}) summed over slots by hand
    (repeated draws, padding slots with a weight, a zero weight); the teacher mass counts each drawn id once."""
    case = make_sampled_case(s=2, b=5, vocab=11, draws=6)
    case["draw_weights"][1, 2, 3] = 0.0
    case["loss_mask"] = torch.ones_like(case["loss_mask"])
    result, _, _ = run_loss(case, impl="dense", tail="sampled")
    log_q = (case["hidden"] @ case["weight"].t()).log_softmax(-1)
    expected, mass = 0.0, 0.0
    for i in range(2):
        for j in range(5):
            drawn = {}
            for slot, (v, l, w) in enumerate(zip(case["teacher_ids"][i, j].tolist(),
                                                 case["teacher_logprobs"][i, j].tolist(),
                                                 case["draw_weights"][i, j].tolist(), strict=True)):
                if l > -math.inf and w > 0:
                    expected += w * (l - float(log_q[i, j, v]))
                    drawn[v] = l
            mass += sum(math.exp(l) for l in drawn.values())
    assert any(len(set(row.tolist())) < 6 for row in case["teacher_ids"].reshape(-1, 6))   # repeats present
    assert rel_err(result.sum("kd loss"), torch.tensor(expected, dtype=torch.float64)) < 1e-12
    assert rel_err(result.sum("teacher top-K mass"), torch.tensor(mass, dtype=torch.float64)) < 1e-12
