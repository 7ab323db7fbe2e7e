"""The fused teacher head (``cache/teacher_head.py``): hidden states and the lm_head shard in, every store kind's rows
out block by block, against the same kind on the whole micro-batch's logits (today's path, formed here as the
reference) at TP 1, 2 and 4 over gloo; blocks of positions and of samples; the padded vocabulary; bad budgets."""

from __future__ import annotations

import pytest
import torch

from megatron_kd_plugin.cache.store.array_names import IDS, REALISED_LOGPROB
from megatron_kd_plugin.cache.store.format import CacheSpec
from tests.distributed import run_on_ranks

S, B, H, VOCAB, PADDED = 11, 3, 16, 45, 48          # 3 padded ids; shards of 48, 24 and 12
SPECS = {            # kind: CacheSpec fields
    "top-K": dict(k=6, temperature=0.8),
    "top-p": dict(k=6, top_p=0.7, min_k=2),
    "sampled": dict(k=5, mode="sampled", proposal_temperature=1.3, sample_seed=3),
    "head + draws": dict(k=7, mode="sampled", head=3, sample_seed=4),
    "cross-tokenizer": dict(k=4, vocab_bytes=10),
}
BUDGETS = {"whole": 2**30, "positions": 3, "samples": 2}        # token rows per block (samples: one position of 2)


def _case():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(S, B, H, generator=gen)                                    # [s, b, H]
    weight = torch.randn(PADDED, H, generator=gen) * torch.linspace(0.2, 2.0, PADDED)[:, None]
    labels = torch.randint(0, VOCAB, (S, B), generator=gen)
    return hidden, weight, labels


def _rows_every_way(tp_group=None, tp_rank: int = 0, tp: int = 1):
    """{(kind, budget): (fused rows, reference rows)} of this rank's shard."""
    from megatron_kd_plugin.cache.teacher_head import TeacherHidden, mask_padded_vocab
    from megatron_kd_plugin.cache.writer import teacher_rows

    hidden, weight, labels = _case()
    shard = weight[tp_rank * PADDED // tp:(tp_rank + 1) * PADDED // tp]
    output = TeacherHidden(hidden=hidden, weight=shard, vocab_size=VOCAB, tp_rank=tp_rank)
    reference_logits = mask_padded_vocab(torch.matmul(hidden, shard.t()), VOCAB, tp_rank)   # today's [s, b, V/tp]
    out = {}
    for kind, fields in SPECS.items():
        spec = CacheSpec(vocab_size=VOCAB, seq_length=S, num_samples=8, **fields)
        reference = teacher_rows(reference_logits, spec, first_sample=2, tp_group=tp_group, labels=labels)
        for name, rows in BUDGETS.items():
            row_bytes = (4 + spec.kind.work_bytes_per_logit) * shard.shape[0]
            fused = teacher_rows(output, spec, first_sample=2, tp_group=tp_group, labels=labels,
                                 chunk_bytes=rows * row_bytes)
            out[kind, name] = (fused, reference)
    return out


def _on_ranks(tp: int):
    from megatron.core import parallel_state

    return _rows_every_way(parallel_state.get_tensor_model_parallel_group(),
                           parallel_state.get_tensor_model_parallel_rank(), tp)


def _check(results: dict, single: dict | None = None):
    for key, ((rows, finite), (ref_rows, ref_finite)) in results.items():
        assert bool(finite.all()) and torch.equal(finite, ref_finite), key
        assert rows.keys() == ref_rows.keys(), key
        assert int(rows[IDS].max()) < VOCAB, key                                   # no padded id
        assert torch.equal(rows[IDS], ref_rows[IDS]), key                         # ids identical
        for name in rows:       # log-probs, LSE, realised: the GEMM's ulps at most (blocks of 3 rows take another
            #                     BLAS kernel than the whole GEMM: a few fp32 ulps of logits ~10, machine-dependent)
            torch.testing.assert_close(rows[name], ref_rows[name], rtol=1e-5, atol=1e-5, msg=str(key))
        if single is not None:                                # TP > 1: the TP=1 rows
            assert torch.equal(rows[IDS], single[key][0][0][IDS]), key


def test_every_kind_blockwise_equals_the_whole_logits_at_tp1():
    results = _rows_every_way()
    _check(results)
    assert REALISED_LOGPROB in results["cross-tokenizer", "samples"][0][0]


@pytest.mark.parametrize("tp", [2, 4])
def test_every_kind_blockwise_equals_the_whole_logits_and_tp1_under_tp(tp):
    single = _rows_every_way()
    for rank_results in run_on_ranks(tp, _on_ranks, tp, timeout=300):
        _check(rank_results, single)


def test_a_budget_below_one_token_row_is_refused_in_one_line():
    from megatron_kd_plugin.cache.teacher_head import TeacherHidden
    from megatron_kd_plugin.cache.writer import teacher_rows

    hidden, weight, _ = _case()
    spec = CacheSpec(vocab_size=VOCAB, seq_length=S, num_samples=8, k=4)
    with pytest.raises(ValueError, match=r"^chunk_bytes=100 is below one token row of the teacher's head \(384 bytes"):
        teacher_rows(TeacherHidden(hidden=hidden, weight=weight, vocab_size=VOCAB), spec, first_sample=0,
                     tp_group=None, chunk_bytes=100)


def test_the_benchmark_sees_the_whole_heads_logits_and_not_the_fused_heads():
    from megatron_kd_plugin.cache.head_benchmark import compare, format_row

    result = compare(tokens=2048, hidden=16, vocab=16384, k=8, chunk_bytes=2**22)
    logits = 2048 * 16384 * 4                                                        # 128 MiB of fp32 logits
    assert result["whole"]["peak_bytes"] >= logits > 8 * result["fused"]["peak_bytes"]
    assert format_row(result, 16384).startswith("| 2K | 1 | ")


def test_the_cache_command_refuses_a_head_budget_below_one_row_before_writing():
    import argparse
    import types

    from megatron_kd_plugin.commands.cache import check_head_chunk

    model = types.SimpleNamespace(vocab_size=PADDED, config=types.SimpleNamespace(params_dtype=torch.bfloat16))
    args = argparse.Namespace(tp=2, head_chunk_bytes=100, mode="topk", top_p=None, head=0)
    with pytest.raises(ValueError, match=r"^--head-chunk-bytes=100: below one token row of the teacher's head "
                                         r"\(144 bytes"):                  # 24 ids x (2 bytes + top-K's 4)
        check_head_chunk(args, model)
    args.head_chunk_bytes = 144
    check_head_chunk(args, model)
