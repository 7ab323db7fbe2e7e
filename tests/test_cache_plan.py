"""The cache's memory plan (``cache/cache_plan.py``): the terms that are exact counts held to what the fused head and
the writer allocate, and its refusals (the whole plan against measured peaks: ``tools/bench_cache_plan.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_kd_plugin.cache.cache_plan import CacheLayout, TeacherShape, head_block_bytes, plan_cache, \
    shard_buffer_bytes
from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.teacher_head import TeacherHidden, head_rows
from megatron_kd_plugin.cache.writer import WriteStats, compute_shard

S, B, V, H = 16, 2, 1000, 8


def layout(**fields) -> CacheLayout:
    spec = fmt.CacheSpec(k=5, vocab_size=V, seq_length=S, num_samples=3, samples_per_shard=3, store_logsumexp=True)
    return CacheLayout(**dict(dict(seq_length=S, micro_batch_size=B, spec=spec, param_bytes=4), **fields))


def test_the_head_block_and_the_shard_buffer_are_what_the_cache_allocates():
    plan_layout = layout(tp=2, head_chunk_bytes=13_000)             # 3 rows of 500 logits x (4 + 4 work) B
    kind = plan_layout.spec.kind
    blocks = []

    def rows_fn(logits, block):
        blocks.append(logits.numel() * (logits.element_size() + kind.work_bytes_per_logit))
        return {"x": logits[..., :1]}, torch.ones(logits.shape[:2], dtype=torch.bool)

    output = TeacherHidden(hidden=torch.randn(S, B, H), weight=torch.randn(V // 2, H), vocab_size=V)
    head_rows(output, rows_fn, first_sample=0, work_bytes_per_logit=kind.work_bytes_per_logit,
              chunk_bytes=plan_layout.head_chunk_bytes)
    assert head_block_bytes(plan_layout, V // 2) == (max(blocks), (1, 2)) == (8000, (1, 2))

    spec = plan_layout.spec
    windows = np.random.default_rng(0).integers(0, V, (3, S + 1))
    masks = (np.ones((3, S), np.uint8), np.tile(np.arange(S, dtype=np.int32), (3, 1)))   # a stream shard's
    arrays = compute_shard(windows, masks, lambda tokens, position_ids: torch.randn(S, tokens.shape[0], V), spec,
                           first_sample=0,
                           micro_batch_size=B, tp_group=None, stats=WriteStats())
    assert shard_buffer_bytes(spec) == windows.nbytes + sum(a.nbytes for a in arrays.values())

    teacher = TeacherShape(layers=2, hidden=H, heads=4, head_dim=2, groups=2, ffn=16, gated=True, vocab_padded=V,
                           moe=False, params_per_gpu=1e4)
    plan = plan_cache(teacher, plan_layout)
    assert plan.gpu_total == plan.weights + max(plan.attention, plan.mlp, plan.head)
    assert plan.cpu_total == plan.gpu_total + plan.shard_buffer


@pytest.mark.parametrize("fields, message", [
    (dict(cp=3), "--seq-length=16 is not a multiple of 2 x --cp = 6"),
    (dict(cp=2, attention="local"), "--cp=2 with local attention"),
    (dict(attention="sdpa"), "attention='sdpa'"),
])
def test_bad_layouts_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        layout(**fields)
    assert "\n" not in str(error.value)


def test_a_head_budget_below_one_token_row_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--head-chunk-bytes=7999: below one token row .*8000 bytes"):
        head_block_bytes(layout(head_chunk_bytes=7999), V)
