"""Tensor parallelism over gloo: TP=2 and TP=4 equal the single-process float64 result, for every formulation."""

from __future__ import annotations

from tests.distributed import run_on_ranks
from tests.test_loss_helpers import make_case, make_sampled_case, rel_err, run_loss
from tests.test_loss_main_grad import ddp_main_grad_on_rank

REAL_VOCAB, PADDED_VOCAB = 45, 48                  # megatron pads the vocab to a multiple of tp (x 128 in practice)

CONFIGS = [
    dict(impl="fused", mode="recompute", tail="ghost", divergence="forward_kl"),
    dict(impl="fused", mode="grad_in_forward", tail="ghost", divergence="jsd", temperature=2.0, alpha=0.4,
         with_labels=True),
    dict(impl="fused", mode="recompute", tail="none", divergence="forward_kl", temperature=0.7, alpha=0.6,
         with_labels=True),
    dict(impl="fused", mode="grad_in_forward", tail="renorm", divergence="reverse_kl", alpha=0.5, with_labels=True),
    dict(impl="fused", tail="renorm", divergence="jsd", temperature=1.5),                 # the K-rows fast path
    dict(impl="fused", mode="recompute", tail="ghost", divergence="reverse_kl", temperature=1.3),
    dict(impl="forward_chunked", tail="ghost", divergence="forward_kl", alpha=0.7, with_labels=True),
    dict(impl="dense", tail="ghost", divergence="jsd", temperature=2.0),
    dict(impl="fused", mode="recompute", tail="sampled", alpha=0.6, with_labels=True),
    dict(impl="fused", mode="grad_in_forward", tail="sampled"),
    dict(impl="forward_chunked", tail="sampled", alpha=0.5, with_labels=True),
]


def _tp_case(k, sampled):
    """A top-K teacher with K = k, or (``sampled``) k draws per token."""
    shape = dict(s=4, b=6, hidden_size=13, vocab=PADDED_VOCAB, teacher_vocab=REAL_VOCAB, seed=3)
    case = make_sampled_case(draws=k, **shape) if sampled else make_case(k=k, **shape)
    case["teacher_ids"][0, :, 0] = PADDED_VOCAB - 2            # an id in the padded vocab, with a little mass
    case["teacher_logprobs"][0, :, 0] = -9.0
    return case


def _tp_body(group, rank: int, size: int, k: int) -> dict:
    """On one rank of ``group``: every config at TP=size (plain and sequence-parallel) against the same config and
    the dense reference at TP=1 on the full weight. Returns the worst relative error of each config."""
    cases = {sampled: _tp_case(k, sampled) for sampled in (False, True)}
    shard = PADDED_VOCAB // size
    rows, seq = slice(rank * shard, (rank + 1) * shard), slice(rank * 4 // size, (rank + 1) * 4 // size)
    errors = {}
    for i, config in enumerate(CONFIGS):
        case = cases[config["tail"] == "sampled"]
        chunk = dict(chunk_bytes=10 * shard * 8 * 2)            # chunks of 10 tokens: T = 24 not divisible
        ref, ref_dh, ref_dw = run_loss(case, **dict(config, impl="dense"))
        single, single_dh, single_dw = run_loss(case, **config, **chunk)
        got, dh, dw = run_loss(case, weight=case["weight"][rows], tp_group=group, **config, **chunk)
        sp, sp_dh, sp_dw = run_loss(case, hidden=case["hidden"][seq], weight=case["weight"][rows], tp_group=group,
                                    sequence_parallel=True, **config, **chunk)
        errors[i] = max(rel_err(single.loss_sum, ref.loss_sum), rel_err(single_dh, ref_dh),
                        rel_err(single_dw, ref_dw),
                        rel_err(got.loss_sum, single.loss_sum), rel_err(dh, single_dh),
                        rel_err(dw, single_dw[rows]), rel_err(got.sum("kd loss"), single.sum("kd loss")),
                        rel_err(got.sum("lm loss"), single.sum("lm loss")) if config.get("with_labels") else 0.0,
                        rel_err(sp.loss_sum, single.loss_sum), rel_err(sp_dh, single_dh[seq]),
                        rel_err(sp_dw, single_dw[rows]))
    return errors


def _tp2_and_tp4():
    """4 ranks: TP=4 on megatron's tensor-parallel group (K=14 > V/tp=12), then TP=2 on two groups of our own
    (K=9) — one spawn for both."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = dist.get_rank()
    tp4 = _tp_body(parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_tensor_model_parallel_world_size(), k=14)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]      # every rank creates every group, in order
    tp2 = _tp_body(pairs[rank // 2], rank % 2, 2, k=9)
    ddp = ddp_main_grad_on_rank(pairs[rank // 2], rank % 2, 2)
    return {"tp4": tp4, "tp2": tp2, "ddp": ddp}


def test_tensor_parallel_equals_single_process():
    """Also, in the same spawn: dW into megatron-core DDP's fp32 main_grad at TP=2 (tests/test_loss_main_grad.py)
    equals the float64 reference to fp32 rounding, and DDP's hook drops the placeholder grad."""
    for rank, result in enumerate(run_on_ranks(4, _tp2_and_tp4, tp=4)):
        for name in ("tp4", "tp2"):
            bad = {CONFIGS[i]["impl"] + str(i): e for i, e in result[name].items() if not e < 1e-9}
            assert not bad, f"{name} rank {rank}: {bad}"
        for mode, (error, grad_dropped) in result["ddp"].items():
            assert error < 2e-6 and grad_dropped, (rank, mode, error, grad_dropped)
