"""Context parallelism in the KD step, over gloo: CP=2 and CP=2 x TP=2, against the unsplit (CP=1) step.

Attention with CP needs Transformer Engine, so the model is a stand-in that hands the KD output processor this
rank's rows of one full-sequence forward's hidden states (picked by the position ids the step gives it). Every
rank also runs the unsplit loss on the full sequence; the checks: the per-rank loss sums, token counts and
report pairs add up over CP to the unsplit ones (they must reach megatron's DP x CP reduction once, so no CP
collective may happen inside the step), each rank's dX is the matching rows of the unsplit dX, dW summed over CP
is the unsplit dW, and every per-token tensor (teacher tensors included) is sliced exactly like the tokens.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.distributed import run_on_ranks

S, B, H, V, K = 16, 2, 12, 24, 5
CP = 2


def _full_batch(seq_length: int, *, sampled: bool = False):
    """A batch-first ``KDRow`` whose every per-token value encodes its position j (so slices reveal positions); a
    ``SampledTeacher`` (its weights sliced too) or a ``TopKTeacher``."""
    from megatron_kd_plugin.cache import KDRow
    from megatron_kd_plugin.loss import SampledTeacher, TopKTeacher

    gen = torch.Generator().manual_seed(0)
    j = torch.arange(seq_length)
    logprobs = (torch.randn(B, seq_length, K, generator=gen, dtype=torch.float64) * 2).log_softmax(-1) - 0.1
    labels = torch.randint(0, V, (B, seq_length), generator=gen)
    loss_mask = (torch.rand(B, seq_length, generator=gen) > 0.2).to(torch.float64)
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(B * seq_length)]).view(B, seq_length, K)
    weights = j.view(1, -1, 1).expand(B, seq_length, K).to(torch.float64) + 0.5
    teacher = SampledTeacher(ids, logprobs, weights) if sampled else TopKTeacher(ids, logprobs)
    return KDRow((j * 7 % V).expand(B, seq_length).clone(), labels, loss_mask, j.expand(B, seq_length).clone(),
                 teacher)


def _tensors(row) -> list[torch.Tensor]:
    """Every tensor of a ``KDRow``, in field order."""
    from megatron_kd_plugin.loss import tensor_map

    found = []
    tensor_map(lambda t: found.append(t) or t, row)
    return found


def _expected_rows(cp_rank: int, cp_size: int, seq_length: int) -> torch.Tensor:
    """Positions CP rank r holds: chunks r and 2·cp−1−r of 2·cp (megatron's load-balanced split)."""
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])


class _FullForwardSlice(torch.nn.Module):
    """Stands in for a CP GPTModel: the final hidden states of one full-sequence forward, cut to the positions
    this rank was given, go to the output processor with this rank's lm_head shard."""

    def __init__(self, hidden_full: torch.Tensor, weight_shard: torch.Tensor, pg_collection):
        super().__init__()
        self.hidden_full = hidden_full                                         # [S, b, H]
        self.weight = torch.nn.Parameter(weight_shard.clone())                 # [V/tp, H]
        self.config = types.SimpleNamespace(sequence_parallel=False, seq_length=hidden_full.shape[0])
        self.pg_collection = pg_collection
        self.local_hidden = None

    def forward(self, *, input_ids, position_ids, attention_mask, labels, output_processor,
                output_processor_context):
        self.local_hidden = self.hidden_full[position_ids[0]].clone().requires_grad_()   # [S/cp, b, H]
        return output_processor(hidden_states=self.local_hidden, output_layer=None, output_weight=self.weight,
                                context=output_processor_context)


def _cp_case(tp: int) -> dict:
    """One parallel layout (TP = ``tp``, CP = 2, DP = the rest): the checks' numbers on this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kd_plugin.bridge.forward_step import get_kd_batch, kd_forward_step, kd_loss_func
    from megatron_kd_plugin.loss import KDLossOptions, tensor_map, topk_kd_loss

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=CP)
    cp_group, tp_group = parallel_state.get_context_parallel_group(), parallel_state.get_tensor_model_parallel_group()
    cp_rank, tp_rank = dist.get_rank(cp_group), dist.get_rank(tp_group)
    rows = _expected_rows(cp_rank, CP, S)
    out = {}

    # 1. every per-token tensor is sliced like the tokens: the rows this rank's position ids name
    full = _full_batch(S, sampled=True)
    local, _ = get_kd_batch(iter([full]), is_first_stage=True, is_last_stage=True, cp_group=cp_group)
    out["sliced"] = {index: torch.equal(mine, whole[:, rows])
                     for index, (mine, whole) in enumerate(zip(_tensors(local), _tensors(full), strict=True))}
    out["sliced"]["count"] = len(out["sliced"]) == 7                    # 4 row tensors, 3 of the teacher's

    # 2. the KD step on the local slice vs the unsplit loss on the full sequence
    options = KDLossOptions(alpha=0.5, temperature=2.0, chunk_bytes=4 * V * 8 * 3)   # a few chunks per rank
    gen = torch.Generator().manual_seed(1)
    hidden_full = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    weight_full = torch.randn(V, H, generator=gen, dtype=torch.float64) / H ** 0.5
    shard = weight_full.chunk(tp)[tp_rank]
    model = _FullForwardSlice(hidden_full, shard, ProcessGroupCollection.use_mpu_process_groups())
    full = _full_batch(S)
    state = types.SimpleNamespace(cfg=types.SimpleNamespace(
        kd=options, rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=True)))
    output, loss_func = kd_forward_step(state, iter([full]), model)
    loss_sum, num_tokens, report = loss_func(output)
    loss_sum.backward()

    ref_hidden, ref_weight = hidden_full.clone().requires_grad_(), shard.clone().requires_grad_()
    ref = topk_kd_loss(ref_hidden, ref_weight, tensor_map(lambda t: t.transpose(0, 1), full.teacher),
                       loss_mask=full.loss_mask.t(), labels=full.labels.t(), tp_group=tp_group, options=options)
    ref_sum, ref_tokens, ref_report = kd_loss_func(ref)
    ref_sum.backward()

    def summed_over_cp(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=cp_group)
        return t

    out["loss_err"] = (summed_over_cp(loss_sum) - ref_sum).abs().item() / ref_sum.abs().item()
    out["tokens"] = (summed_over_cp(num_tokens).item(), ref_tokens.item(), num_tokens.item())
    out["report_err"] = max((summed_over_cp(report[k]) - ref_report[k]).abs().max().item() for k in ref_report)
    out["report_keys"] = sorted(report) == sorted(ref_report)
    out["dx_err"] = (model.local_hidden.grad - ref_hidden.grad[rows]).abs().max().item()
    out["dx_scale"] = ref_hidden.grad.abs().max().item()
    out["dw_err"] = (summed_over_cp(model.weight.grad) - ref_weight.grad).abs().max().item()
    out["dw_local_differs"] = (model.weight.grad - ref_weight.grad).abs().max().item()

    # 3. a row length that 2·cp does not divide is refused with the offending length
    try:
        get_kd_batch(iter([_full_batch(S + 2)]), is_first_stage=True, is_last_stage=True, cp_group=cp_group)
        out["refusal"] = None
    except ValueError as error:
        out["refusal"] = str(error)
    return out


def _cp_body() -> dict:
    """CP=2 (x DP=2), then CP=2 x TP=2, in one spawn of 4 ranks."""
    return {tp: _cp_case(tp) for tp in (1, 2)}


def test_kd_step_under_context_parallelism_equals_the_unsplit_step():
    results = run_on_ranks(4, _cp_body, tp=1)
    for rank, per_layout in enumerate(results):
        for tp, r in per_layout.items():
            where = f"rank {rank}, CP=2 x TP={tp}"
            assert all(r["sliced"].values()), (where, r["sliced"])
            assert r["loss_err"] < 1e-12, (where, r["loss_err"])
            total, ref_total, local_tokens = r["tokens"]
            assert total == ref_total and 0 < local_tokens < ref_total, (where, r["tokens"])
            assert r["report_keys"] and r["report_err"] < 1e-10, (where, r["report_err"])
            assert r["dx_err"] < 1e-12 * r["dx_scale"] + 1e-14, (where, r["dx_err"])
            assert r["dw_err"] < 1e-12, (where, r["dw_err"])
            assert r["dw_local_differs"] > 1e-3, where              # one rank's dW alone is partial
            assert r["refusal"] is not None and "18" in r["refusal"], (where, r["refusal"])
            assert "2 * context_parallel_size = 4" in r["refusal"], (where, r["refusal"])


def test_config_refuses_a_seq_length_that_2cp_does_not_divide():
    from megatron_kd_plugin.bridge.config import check_kd_config
    from megatron_kd_plugin.recipes import RECIPES

    cfg = RECIPES["tiny_gpt_kd_cpu_fp32_config"]()
    cfg.model.context_parallel_size = 4
    cfg.model.seq_length = cfg.dataset.seq_length = 36
    with pytest.raises(ValueError, match=r"model.seq_length=36 is not a multiple of 2 \* context_parallel_size = 8"):
        check_kd_config(cfg)
