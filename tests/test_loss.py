"""Fused and forward-chunked top-K KD against the dense float64 autograd reference, single process."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_loss_helpers import (COMBOS, combo, make_case, make_sampled_case, one_thread,  # noqa: F401 (fixture)
                                     rel_err, run_loss, token_kd_from_definition)

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = [dict(impl="fused", mode="recompute"), dict(impl="fused", mode="grad_in_forward"),
        dict(impl="forward_chunked")]


def _compare(case, options, fast_options, rtol, nonzero=True):
    ref, ref_dh, ref_dw = run_loss(case, impl="dense", **options)
    assert torch.isfinite(ref.loss_sum) and torch.isfinite(ref_dh).all() and torch.isfinite(ref_dw).all()
    assert not nonzero or (ref.loss_sum.abs() > 0 and ref_dh.abs().max() > 0), options
    for fast in fast_options:
        got, dh, dw = run_loss(case, **options, **fast)
        where = f"{options} {fast}"
        assert rel_err(got.loss_sum, ref.loss_sum) < rtol, where
        assert rel_err(dh, ref_dh) < rtol, where
        assert rel_err(dw, ref_dw) < rtol, where
        assert got.report.keys() == ref.report.keys(), where
        for name, pair in got.report.items():
            if not math.isnan(float(pair[0])):
                assert rel_err(pair, ref.report[name]) < rtol, (where, name)
        assert int(got.num_tokens) == int(ref.num_tokens) == int((case["loss_mask"] != 0).sum())


@pytest.mark.parametrize("tail,divergence", COMBOS)
def test_matches_dense_float64(tail, divergence):
    """Every tail x divergence x tau x CE mix x formulation: loss and both gradients, rtol 1e-6 in float64.
    3x47 tokens, chunks of 10 tokens (T not divisible), duplicate ids, padding slots, a fully masked sequence."""
    case = make_case()
    for temperature in (1.0, 2.5):
        for alpha, with_labels in ((1.0, False), (0.3, True)):
            options = combo(dict(temperature=temperature, alpha=alpha, with_labels=with_labels, jsd_beta=0.3),
                            tail=tail, divergence=divergence)
            _compare(case, options, [dict(f, chunk_bytes=10 * 123 * 8 * 2) for f in FAST], rtol=1e-6)


def test_sampled_matches_dense_float64():
    """tail=sampled, every formulation, with and without the CE mix: 3x47 tokens, 9 draws per token (repeated ids),
    padding slots carrying a weight, a zero weight, a fully masked sequence, chunks of 10 tokens; rtol 1e-6."""
    case = make_sampled_case()
    case["draw_weights"][0, 0, 0] = 0.0                       # a slot with no weight is no bucket
    ids = case["teacher_ids"].long()
    assert (ids.sort(-1).values.diff(dim=-1) == 0).any(-1).float().mean() > 0.5    # most tokens repeat an id
    for alpha, with_labels in ((1.0, False), (0.3, True)):
        options = dict(tail="sampled", alpha=alpha, with_labels=with_labels)
        _compare(case, options, [dict(f, chunk_bytes=10 * 123 * 8) for f in FAST], rtol=1e-6)


def test_renorm_fast_path_uses_only_k_rows():
    """tail=renorm without labels: matches dense and never forms a [T, V]-sized tensor (nor [c, V])."""
    case = make_case(vocab=2000, k=3)
    ref, ref_dh, ref_dw = run_loss(case, impl="dense", tail="renorm", temperature=1.7)
    with _MaxNumel() as seen:
        got, dh, dw = run_loss(case, impl="fused", tail="renorm", temperature=1.7)
    assert math.isnan(float(got.sum("student top-K mass")))          # the fast path has no full-vocab normaliser
    assert rel_err(got.loss_sum, ref.loss_sum) < 1e-6 and rel_err(dh, ref_dh) < 1e-6 and rel_err(dw, ref_dw) < 1e-6
    tokens = case["hidden"].shape[0] * case["hidden"].shape[1]
    assert seen.largest == 2000 * 31 < tokens * 2000, seen.largest     # nothing bigger than W (or dW)


def test_renorm_fast_path_gradients_repeat_to_the_bit_on_several_threads():
    """The renorm path's dW adds T*K rows into V rows (many tokens share a slot id): two CPU threads, float32, the
    same inputs give the same gradients bit for bit every time (a parallel accumulate made two heals of the same
    command differ from their third step on)."""
    case = make_case(s=8, b=64, hidden_size=64, vocab=40, k=16, duplicates=False, padding=False)
    case = {name: value.float() if value.is_floating_point() else value for name, value in case.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = {tuple(run_loss(case, impl="fused", tail="renorm")[2].flatten().tolist()) for _ in range(6)}
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces (dense elements, or stored entries of a sparse one)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, tuple | list) else (out,)):
            if isinstance(t, torch.Tensor):                      # sparse: its stored entries
                self.largest = max(self.largest, t.numel() if t.layout == torch.strided else t._nnz())
        return out


@pytest.mark.parametrize("mode", ["recompute", "grad_in_forward"])
def test_fused_never_materialises_logits(mode):
    """The largest tensor the fused loss creates (forward + backward) is one chunk of logits, not [T, V]."""
    case = make_case(s=8, b=16, vocab=500, k=6)
    chunk = 16
    with _MaxNumel() as seen:
        run_loss(case, impl="fused", mode=mode, chunk_bytes=chunk * 500 * 8, tail="ghost")
    assert seen.largest == max(chunk * 500, 500 * 31), seen.largest   # a chunk of logits, or W / dW


@pytest.mark.parametrize("k,vocab", [(1, 50), (50, 50), (60, 50)])
def test_edge_k(k, vocab):
    """K = 1, K = V (the ghost tail bucket is empty) and K > V (repeated ids fill the extra slots)."""
    case = make_case(s=2, b=5, vocab=vocab, k=min(k, vocab), duplicates=False, padding=False)
    if k > vocab:                                               # extra slots repeat ids with -inf (padding)
        extra = k - vocab
        case["teacher_ids"] = torch.cat([case["teacher_ids"], case["teacher_ids"][..., :extra]], -1)
        case["teacher_logprobs"] = torch.cat([case["teacher_logprobs"],
                                              torch.full_like(case["teacher_logprobs"][..., :extra], -torch.inf)], -1)
    for tail, divergence in COMBOS:
        options = dict(tail=tail, divergence=divergence, temperature=1.3)
        _compare(case, options, [dict(f, chunk_bytes=1) for f in FAST], rtol=1e-6,   # chunks of 1 token
                 nonzero=not (k == 1 and tail == "renorm"))                         # one bucket: KL = 0


def test_fully_masked_batch_gives_zero_and_zero_grads():
    case = make_case(s=2, b=4)
    case["loss_mask"] = torch.zeros_like(case["loss_mask"])
    result, dh, dw = run_loss(case, impl="fused", with_labels=True, alpha=0.5)
    assert float(result.loss_sum) == 0.0 and int(result.num_tokens) == 0
    assert not dh.any() and not dw.any()


def test_ghost_matches_megatron_core_peer():
    """Independent check of the ghost forward KL (tau = 1) against megatron-core's own ``topk_kl_div``."""
    cached_logits_loss = pytest.importorskip("megatron.training.distillation.cached_logits_loss")
    case = make_case(duplicates=False, padding=False)
    logits = case["hidden"] @ case["weight"].t()                              # [s, b, V]
    peer = cached_logits_loss.topk_kl_div(logits.clone(), case["teacher_logprobs"], case["teacher_ids"].long(),
                                          1, 0, None, add_ghost_token=True).t()   # [s, b]
    result, _, _ = run_loss(case, impl="fused")
    assert rel_err(result.loss_sum, (peer * case["loss_mask"]).sum()) < 1e-6      # the peer computes in fp32


@pytest.mark.parametrize("tail,divergence", COMBOS)
def test_dense_reference_matches_definition(tail, divergence):
    """The reference itself, token by token, against distributions built by hand (with duplicates, padding)."""
    case = make_case(s=2, b=3, vocab=11, k=4)
    case["loss_mask"] = torch.ones_like(case["loss_mask"])
    tau, beta = 1.7, 0.3
    result, _, _ = run_loss(case, impl="dense", **combo(dict(temperature=tau, jsd_beta=beta), tail=tail,
                                                        divergence=divergence))
    z = case["hidden"] @ case["weight"].t()
    expected = sum(token_kd_from_definition(z[i, j], case["teacher_ids"][i, j], case["teacher_logprobs"][i, j],
                                            tail, divergence, tau, beta)[0] for i in range(2) for j in range(3))
    assert rel_err(result.sum("kd loss"), expected) < 1e-10
    assert rel_err(result.loss_sum, tau ** 2 * expected) < 1e-10


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 2e-4), (torch.bfloat16, 1.5e-2)])
def test_low_precision_inputs_accumulate_in_fp32(dtype, rtol):
    """fp32/bf16 inputs: the fused loss against the float64 dense reference on the same (rounded) inputs. The
    bound is the output's rounding (bf16 gradients: 2^-8 relative), far below what a wrong gradient gives."""
    case = make_case()
    low = make_case(dtype=dtype)
    exact = dict(case, hidden=low["hidden"].double(), weight=low["weight"].double())
    for tail, divergence in (("ghost", "forward_kl"), ("renorm", "jsd"), ("none", "forward_kl")):
        options = dict(tail=tail, divergence=divergence, temperature=2.0, alpha=0.5, with_labels=True)
        ref, ref_dh, ref_dw = run_loss(exact, impl="dense", **options)
        for mode in ("recompute", "grad_in_forward"):
            got, dh, dw = run_loss(low, impl="fused", mode=mode, **options)
            assert got.loss_sum.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
            assert rel_err(got.loss_sum, ref.loss_sum) < 1e-5
            assert rel_err(dh, ref_dh) < rtol and rel_err(dw, ref_dw) < rtol, (tail, mode)


def test_reduced_columns_round_trip_and_refuse_an_undeclared_column():
    """The chunk's SUM all-reduce layout: every formed field comes back where it was packed, whatever subset the
    plan forms, and a backend that forms a column the layout does not declare (or misses one) is refused."""
    from megatron_kd_plugin.loss.token_math import REDUCED_FIELDS, ReducedColumns

    c, k = 3, 4
    values = {name: torch.randn(c, k) if name == "support_logits" else torch.randn(c) for name in REDUCED_FIELDS}
    row_max = torch.randn(c)
    for optional in ((), ("label_logit",), ("label_logit", "ce_sum_exp"), ("unit_tail_sum",), REDUCED_FIELDS[2:]):
        fields = tuple(name for name in REDUCED_FIELDS if name in ("tail_sum", "support_logits") + optional)
        layout = ReducedColumns(fields, k)
        packed = layout.pack(**{name: values[name] for name in fields})
        assert packed.shape == (c, layout.width) == (c, k + len(fields) - 1)
        partials = layout.unpack(packed, row_max)
        for name in REDUCED_FIELDS:
            expected = values[name] if name in fields else None
            assert (getattr(partials, name) is None) if expected is None else torch.equal(getattr(partials, name),
                                                                                          expected), (fields, name)
        assert torch.equal(partials.row_max, row_max)
    layout = ReducedColumns(("tail_sum", "support_logits"), k)
    with pytest.raises(ValueError, match="formed"):
        layout.pack(**{name: values[name] for name in ("tail_sum", "support_logits", "label_logit")})
    with pytest.raises(ValueError, match="in that order"):
        ReducedColumns(("support_logits", "tail_sum"), k)
