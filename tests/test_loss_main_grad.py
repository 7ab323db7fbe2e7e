"""dW into megatron-core DDP's fp32 main_grad (megatron's gradient-accumulation convention), with no [V/tp, H] buffer
beyond what the mode must hold: against the float64 dense reference, in one process and under real DDP at TP=2."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_kd_plugin.loss import topk_kd_loss
from tests.test_loss_helpers import make_case, one_thread, rel_err, run_loss, teacher_of  # noqa: F401

SHAPE = dict(s=4, b=6, hidden_size=32, vocab=256, k=5)
CHUNK = 8 * 256 * 4                      # chunks of 8 fp32 logits rows; weight blocks of 16 rows for a bf16 weight


class _LargeAllocations(TorchDispatchMode):
    """Counts op outputs with a fresh storage of at least ``numel`` elements (not one of ``known`` tensors')."""

    def __init__(self, numel: int, known):
        super().__init__()
        self.numel, self.known, self.seen = numel, {t.untyped_storage().data_ptr() for t in known}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                pointer = t.untyped_storage().data_ptr()
                if pointer not in self.known:
                    self.known.add(pointer)
                    self.seen.append((str(func), tuple(t.shape), t.dtype))
        return out


def _reference(case, **options):
    """float64 dense loss and gradients of the case's (rounded) inputs."""
    exact = dict(case, hidden=case["hidden"].double(), weight=case["weight"].double())
    return run_loss(exact, impl="dense", **options)


def _fused_into_main_grad(case, prior, **options):
    """Fused loss with a bf16 weight carrying DDP's attributes; returns (result, dX, main_grad, weight, big allocs)."""
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    weight.main_grad = prior.clone()
    weight.grad_added_to_main_grad = False
    with _LargeAllocations(weight.numel(), [weight, weight.main_grad, hidden]) as allocations:
        result = topk_kd_loss(hidden, weight, teacher_of(case),
                              loss_mask=case["loss_mask"], labels=case["labels"], chunk_bytes=CHUNK, kernels="torch",
                              **options)
        result.loss_sum.backward()
    return result, hidden.grad, weight, allocations.seen


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode,held", [("recompute", 0), ("grad_in_forward", 1)])
def test_dw_accumulates_into_fp32_main_grad(mode, held):
    """bf16 weight, fp32 main_grad holding an earlier microbatch's dW: main_grad gains the fp32 dW (equal to the
    float64 reference to fp32 rounding, not bf16's 4e-3), DDP is told (grad_added_to_main_grad), the returned
    placeholder costs no memory, and no [V, H] tensor is allocated beyond grad_in_forward's held fp32 dW (no fp32
    copy of the weight, no bf16 dW)."""
    case = make_case(**SHAPE, dtype=torch.bfloat16)
    options = dict(temperature=1.5, alpha=0.7, with_labels=True)
    ref, ref_dh, ref_dw = _reference(case, **options)
    prior = torch.randn(case["weight"].shape, generator=torch.Generator().manual_seed(1))
    options.pop("with_labels")
    result, d_hidden, weight, allocations = _fused_into_main_grad(case, prior, mode=mode, **options)
    assert rel_err(result.loss_sum, ref.loss_sum) < 1e-6
    assert rel_err(weight.main_grad - prior, ref_dw) < 2e-6, rel_err(weight.main_grad - prior, ref_dw)
    assert weight.grad_added_to_main_grad is True
    assert weight.grad is None or weight.grad.data_ptr() == weight.data_ptr()      # a placeholder, not a dW
    assert rel_err(d_hidden, ref_dh) < 1e-2                                          # dX is rounded to bf16
    assert len(allocations) == held and all(dtype == torch.float32 for _, _, dtype in allocations), allocations
    before = weight.detach().clone()
    again = topk_kd_loss(weight=weight, hidden=case["hidden"].clone().requires_grad_(), teacher=teacher_of(case),
                         mode=mode, loss_mask=case["loss_mask"], labels=case["labels"], chunk_bytes=CHUNK,
                         kernels="torch", **options)
    again.loss_sum.backward()                              # no DDP hook dropped the first placeholder
    assert torch.equal(weight.detach(), before) and rel_err(weight.main_grad - prior, 2 * ref_dw) < 2e-6


@pytest.mark.usefixtures("one_thread")
def test_main_grad_off_or_unusable_returns_dw():
    """accumulate_main_grad=False, or a bf16 main_grad: dW is returned as weight.grad and main_grad is untouched."""
    case = make_case(**SHAPE, dtype=torch.bfloat16)
    prior = torch.randn(case["weight"].shape, generator=torch.Generator().manual_seed(1))
    _, _, ref_dw = _reference(case)
    for prior_dtype, flag in ((torch.float32, False), (torch.bfloat16, True)):
        _, _, weight, _ = _fused_into_main_grad(case, prior.to(prior_dtype), accumulate_main_grad=flag)
        assert torch.equal(weight.main_grad, prior.to(prior_dtype)) and weight.grad_added_to_main_grad is False
        assert weight.grad.dtype == torch.bfloat16 and rel_err(weight.grad, ref_dw) < 1e-2


def ddp_main_grad_on_rank(group, rank: int, size: int) -> dict:
    """On one rank of TP group ``group``: megatron-core DDP (fp32 grad buffer, overlap_grad_reduce, whose hook
    asserts that a grad arrives) around a module holding hidden states and this rank's bf16 lm_head shard; two
    microbatches per mode accumulate. Returns each mode's worst error of main_grad against 2 x the float64 dW shard,
    and whether DDP's hook cleared the placeholder. Run by tests/test_loss_tp.py's spawn (one spawn for all)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    case = make_case(**SHAPE, dtype=torch.bfloat16)
    _, _, ref_dw = _reference(case)
    shard = SHAPE["vocab"] // size
    rows = slice(rank * shard, (rank + 1) * shard)
    config = TransformerConfig(num_layers=1, hidden_size=SHAPE["hidden_size"], num_attention_heads=1,
                               params_dtype=torch.bfloat16, bf16=True)
    results = {}
    for mode in ("recompute", "grad_in_forward"):
        module = torch.nn.Module()
        module.hidden = torch.nn.Parameter(case["hidden"].clone())
        module.weight = torch.nn.Parameter(case["weight"][rows].clone())
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                            overlap_grad_reduce=True), module)
        ddp.zero_grad_buffer()
        for _ in range(2):
            result = topk_kd_loss(module.hidden, module.weight, teacher_of(case),
                                  loss_mask=case["loss_mask"], tp_group=group, mode=mode, chunk_bytes=CHUNK,
                                  kernels="torch")
            result.loss_sum.backward()
        results[mode] = (rel_err(module.weight.main_grad, 2 * ref_dw[rows]), module.weight.grad is None)
    return results
