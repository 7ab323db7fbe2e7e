"""The fused loss on the Triton kernels (collected through tests/test_loss_triton.py): loss, dX and dW against the
float64 dense reference for every tail x divergence, CE mix at tau != 1, both modes, masked rows, and at TP=2; the
cross-tokenizer loss's one pass (label log-probs and the token-level term) against its float64 reference.

On CPU this module must run in a process that had TRITON_INTERPRET=1 before triton was first imported (see
tests/test_kernels.py); the PyTorch chunk backend is made to raise, so a silent fallback fails the checks.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.kernels import reference
from megatron_kd_plugin.loss.chunk_backends import TorchChunks
from tests.distributed import run_on_ranks
from tests.test_loss_helpers import (COMBOS, SATURATED_COMBOS, combo, make_case, make_head_draws_case, make_ragged_case,
                                     make_sampled_case, make_saturated_case, make_small_tail_case, rel_err, run_loss)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 45                                  # odd; crosses the interpreter's 32-column tiles and 48-column splits
SHAPE = dict(s=3, b=5, hidden_size=11, vocab=VOCAB, k=5)
CHUNK = dict(chunk_bytes=4 * VOCAB * 4)     # fp32 logits: chunks of 4 tokens, T = 15 not divisible
OPTIONS = [dict(temperature=1.0, alpha=1.0), dict(temperature=1.7, alpha=0.4, with_labels=True, jsd_beta=0.3)]


@pytest.fixture(autouse=True)
def no_torch_chunks(monkeypatch):
    """Any use of the PyTorch chunk backend (or the kernels' PyTorch reference) is an error here."""
    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch chunk path ran")
    monkeypatch.setattr(TorchChunks, "load", refuse)
    monkeypatch.setattr(reference, "chunk_row_stats", refuse)
    monkeypatch.setattr(reference, "chunk_logit_grad_", refuse)


def _on_device(case, dtype):
    low = {k: v.to(DEVICE) for k, v in case.items()}
    low["hidden"], low["weight"] = case["hidden"].to(dtype).to(DEVICE), case["weight"].to(dtype).to(DEVICE)
    exact = dict(low, hidden=low["hidden"].double(), weight=low["weight"].double())   # the same rounded inputs
    return low, exact


def _errors(low, exact, options, modes=("recompute", "grad_in_forward"), **extra) -> dict[str, float]:
    """Relative error of loss, dX, dW, kd/ce sums and the student's top-K mass, per mode: {"mode name": error}."""
    ref, ref_dh, ref_dw = run_loss(exact, impl="dense", **options)
    assert ref.loss_sum.abs() > 0 and ref_dh.abs().max() > 0 and ref_dw.abs().max() > 0, options
    errors = {}
    for mode in modes:
        got, dh, dw = run_loss(low, impl="fused", mode=mode, kernels="triton", **options, **extra)
        assert dh.dtype == low["hidden"].dtype and dw.dtype == low["weight"].dtype
        pairs = dict(loss=(got.loss_sum, ref.loss_sum), dX=(dh, ref_dh), dW=(dw, ref_dw))
        sums = ["kd loss", "student top-K mass"] + (["lm loss"] if options.get("with_labels") else [])
        pairs.update({name: (got.sum(name), ref.sum(name)) for name in sums})
        errors.update({f"{mode} {name}": rel_err(*pair) for name, pair in pairs.items()})
    return errors


def _check(low, exact, options, bound, **extra):
    """Every error of ``_errors`` below ``bound`` (a NaN fails); the message names each error over it."""
    errors = _errors(low, exact, options, **extra)
    over = {name: f"{error:.2e}" for name, error in errors.items() if not error < bound}
    assert not over, f"{options}: over {bound:.0e}: {over}"


@pytest.mark.parametrize("tail,divergence", COMBOS)
def test_triton_fused_matches_dense_float64(tail, divergence):
    """fp32 inputs, chunks of 4 tokens, duplicate ids, padding slots, a fully masked sequence, 20% masked tokens.
    (renorm without labels takes the K-rows fast path, which has no vocab chunks: only its CE mix runs here.)"""
    low, exact = _on_device(make_case(**SHAPE), torch.float32)
    for options in OPTIONS:
        if tail == "renorm" and not options.get("with_labels"):
            continue
        options = combo(options, tail=tail, divergence=divergence)
        _check(low, exact, options, 1e-5, **CHUNK)


@pytest.mark.parametrize("make", [make_sampled_case, make_head_draws_case])
def test_triton_fused_sampled(make):
    """tail=sampled on draws (repeats, padding slots) and on head + draws rows, with and without the CE mix, chunks
    of 4 tokens."""
    low, exact = _on_device(make(draws=6, **SHAPE), torch.float32)
    for options in (dict(tail="sampled"), dict(tail="sampled", alpha=0.4, with_labels=True)):
        _check(low, exact, options, 1e-5, **CHUNK)


def test_triton_fused_k_equals_v():
    """K = V: the support covers the vocab (every column excluded from the tail sum, the ghost tail bucket absent),
    chunks of 1 token."""
    low, exact = _on_device(make_case(s=2, b=3, hidden_size=11, vocab=20, k=20, duplicates=False, padding=False),
                            torch.float32)
    for tail, divergence in (("ghost", "forward_kl"), ("ghost", "jsd"), ("none", "forward_kl")):
        options = dict(tail=tail, divergence=divergence, temperature=1.3, alpha=0.5, with_labels=True)
        _check(low, exact, options, 1e-5, chunk_bytes=1)


@pytest.mark.parametrize("tail,divergence", SATURATED_COMBOS)
def test_triton_fused_saturated(tail, divergence):
    """Issue 15 item 7 on the kernels: a saturated teacher against an fp32-underflowing student tail (renorm with the
    CE mix, so that it takes the chunk loop): finite, and equal to float64."""
    low, exact = _on_device(make_saturated_case(), torch.float32)
    options = dict(tail=tail, divergence=divergence, temperature=1.3)
    if tail == "renorm":
        options.update(alpha=0.5, with_labels=True)
    _check(low, exact, options, 1e-5, chunk_bytes=4 * 8 * 4)


def test_triton_fused_small_teacher_tail():
    """Issue 15 item 8 on the kernels: a ghost reverse KL whose teacher tail (1e-8) is below fp32's resolution."""
    tail_case = {key: value[:, :4] for key, value in make_small_tail_case(1e-8).items() if key != "weight"}
    low, exact = _on_device(dict(tail_case, weight=make_small_tail_case(1e-8)["weight"]), torch.float32)
    _check(low, exact, dict(tail="ghost", divergence="reverse_kl"), 1e-5, chunk_bytes=8 * 64 * 4)


def test_triton_fused_bf16_inputs():
    """bf16 X and W: bf16 logits chunks and gradient, fp32 accumulation of dX and dW (bf16 rounding bound)."""
    low, exact = _on_device(make_case(**SHAPE), torch.bfloat16)
    options = dict(tail="ghost", divergence="forward_kl", temperature=1.7, alpha=0.4, with_labels=True)
    _check(low, exact, options, 1.5e-2, chunk_bytes=4 * VOCAB * 2)


def test_triton_choice_is_resolved():
    """auto picks Triton here (interpreter or CUDA), float64 inputs fall back to torch under auto and are refused
    under triton."""
    low, exact = _on_device(make_case(**SHAPE), torch.float32)
    options = dict(tail="ghost", divergence="reverse_kl", temperature=1.3)
    with pytest.raises(AssertionError, match="PyTorch chunk path ran"):
        run_loss(low, impl="fused", kernels="torch", **options)      # the guard catches the torch path...
    run_loss(low, impl="fused", **options)                           # ...auto does not take it...
    with pytest.raises(AssertionError, match="PyTorch chunk path ran"):
        run_loss(exact, impl="fused", **options)                     # ...but takes it for float64
    with pytest.raises(ValueError, match="float64"):
        run_loss(exact, impl="fused", kernels="triton", **options)


def _tp2_body():
    """One rank of TP=2: the Triton fused loss on this rank's vocab shard (a padded vocab) equals the float64 dense
    reference on the full weight. Returns the worst relative error."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.kernels import use_triton

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    case = make_case(s=2, b=5, hidden_size=11, vocab=48, teacher_vocab=45, k=6, seed=3)
    low, exact = _on_device(case, torch.float32)
    assert use_triton(low["hidden"], "auto")
    rows = slice(rank * 24, (rank + 1) * 24)
    worst = 0.0
    for options in (dict(tail="ghost", divergence="jsd", temperature=1.7, alpha=0.4, with_labels=True),
                    dict(tail="none", divergence="forward_kl", temperature=0.7, alpha=0.6, with_labels=True)):
        ref, ref_dh, ref_dw = run_loss(exact, impl="dense", **options)
        for mode in ("recompute", "grad_in_forward"):
            got, dh, dw = run_loss(low, weight=low["weight"][rows], tp_group=group, impl="fused", mode=mode,
                                   kernels="triton", chunk_bytes=4 * 24 * 4, **options)
            worst = max(worst, rel_err(got.loss_sum, ref.loss_sum), rel_err(dh, ref_dh),
                        rel_err(dw, ref_dw[rows]), rel_err(got.sum("lm loss"), ref.sum("lm loss")))
    return worst


@pytest.mark.skipif(DEVICE == "cuda", reason="the gloo harness runs on CPU; GPU TP is megatron's own NCCL setup")
def test_triton_fused_tp2_matches_dense():
    """TP=2 over gloo with the interpreted kernels (the spawned ranks inherit TRITON_INTERPRET=1)."""
    worst = run_on_ranks(2, _tp2_body)
    assert max(worst) < 1e-5, worst


def test_triton_fused_ragged_rows():
    """A top-p store's ragged rows (1 to K real slots, padding id 0 / -inf, a kept id 0): each tail through the chunk
    loop (renorm with the CE mix), both modes, against the float64 dense reference (every tail x divergence of
    these rows against the float64 definitions: tests/test_loss_ragged.py)."""
    low, exact = _on_device(make_ragged_case(s=3, b=5, hidden_size=11, vocab=VOCAB, k=5), torch.float32)
    for tail, divergence in (("ghost", "forward_kl"), ("ghost", "reverse_kl"), ("none", "forward_kl"),
                             ("renorm", "jsd")):
        options = combo(OPTIONS[1] if tail == "renorm" else OPTIONS[0], tail=tail, divergence=divergence)
        _check(low, exact, options, 1e-5, **CHUNK)


def test_triton_cross_tokenizer_loss_matches_float64():
    """The cross-tokenizer loss (``cross_tokenizer_loss``: the per-token pass, CE and KD coefficients apart) on the
    kernels, fp32 inputs, chunks of 4 tokens: loss and both gradients against tests/test_cross_tokenizer.py's float64
    reference, ALM alone and with the token-level term."""
    from megatron_kd_plugin.loss import cross_tokenizer_loss, tensor_map
    from tests.test_cross_tokenizer import (CASES, cross_teacher, expected_token_targets, loss_inputs, reference_loss,
                                            token_inputs)

    inputs = loss_inputs()
    for case in CASES:
        hidden = inputs[0].float().to(DEVICE).requires_grad_()
        weight = inputs[1].float().to(DEVICE).requires_grad_()
        tokens = token_inputs(inputs[2]) if "token_weight" in case else None
        exact_teacher = cross_teacher(inputs[3], inputs[4], tokens)
        teacher = tensor_map(lambda t: (t.float() if t.is_floating_point() else t).to(DEVICE), exact_teacher)
        result = cross_tokenizer_loss(hidden, weight, teacher, labels=inputs[2].to(DEVICE),
                                      loss_mask=inputs[5].to(DEVICE), chunk_bytes=4 * 30 * 4, kernels="triton",
                                      **case)
        result.loss_sum.backward()
        exact_hidden = hidden.detach().double().cpu().requires_grad_()      # the same rounded inputs
        exact_weight = weight.detach().double().cpu().requires_grad_()
        targets = {} if tokens is None else dict(zip(("teacher_ids", "teacher_logprobs"),
                                                     expected_token_targets(exact_teacher, inputs[2])))
        expected = reference_loss(exact_hidden, exact_weight, *inputs[2:], **case, **targets)
        expected.backward()
        errors = [rel_err(result.loss_sum.cpu(), expected), rel_err(hidden.grad.cpu(), exact_hidden.grad),
                  rel_err(weight.grad.cpu(), exact_weight.grad)]
        assert max(errors) < 1e-5, (case, errors)
