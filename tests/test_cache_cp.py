"""Context parallelism in the cache writer, over gloo: CP=2 and CP=2 x TP=2 stores of every kind against the CP=1 store.

Attention with CP needs Transformer Engine (megatron-core's local attention refuses it), so the teacher is a
stand-in GPTModel: it hands the ``output_processor`` this rank's rows of one full-window forward's hidden states,
picked by the position ids ``TeacherForward`` gives it (megatron-core's load-balanced slicing), and its lm_head shard.
What the test proves: the slicing of tokens and position ids, the fused head on each rank's two chunks at their
global positions (the draws' uniforms), the writer's reassembly over CP and its single writer, and the stores equal
to the unsplit ones. Only on GPU: the teacher's CP attention itself (Transformer Engine).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks

V, PADDED, H, S, N = 50, 52, 8, 16, 6
KINDS = {"top-K": dict(k=5), "top-p": dict(k=5, top_p=0.6, min_k=1),
         "sampled": dict(k=4, mode="sampled", proposal_temperature=1.2, sample_seed=2),
         "head + draws": dict(k=6, mode="sampled", head=2, sample_seed=3)}


class StandIn(torch.nn.Module):
    """A GPTModel's last stage for ``TeacherForward``: hidden state of (token, position) from fixed tables."""

    def __init__(self, tp_rank: int, tp: int):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.tokens, self.positions = torch.randn(V, H, generator=gen), torch.randn(S, H, generator=gen)
        self.weight = torch.nn.Parameter(2 * torch.randn(PADDED, H, generator=gen)[tp_rank * PADDED // tp:
                                                                                   (tp_rank + 1) * PADDED // tp])
        self.config = None
        self.seen = []

    def forward(self, tokens, position_ids, attention_mask, *, output_processor):
        self.seen.append(position_ids[0].tolist())
        hidden = (self.tokens[tokens] + self.positions[position_ids]).transpose(0, 1)          # [s/cp, b, H]
        layer = torch.nn.Module()
        layer.weight, layer.bias = self.weight, None
        return output_processor(hidden_states=hidden, output_layer=layer, output_weight=None,
                                scale_logits=lambda logits: logits)


def _stores(work: str, cp: int, tp: int):
    import numpy as np
    from megatron.core import parallel_state

    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.teacher_forward import TeacherForward
    from megatron_kd_plugin.cache.writer import write_cache

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    model = StandIn(tp_rank, tp)
    teacher = TeacherForward([model], vocab_size=V, tp_rank=tp_rank, cp_group=parallel_state.get_context_parallel_group())
    stream = np.random.default_rng(1).integers(0, V, N * S + 1)
    source = TokenWindows(stream, S, num_samples=N, fingerprint="cp", tokenizer="tok", tokenizer_vocab_size=V)
    for name, fields in KINDS.items():
        write_cache(source, teacher, f"{work}/{name}_cp{cp}_tp{tp}.zarr", vocab_size=V, teacher="stand-in",
                    samples_per_shard=3, micro_batch_size=2, logprob_codec="fp32", progress=False,
                    tp_group=parallel_state.get_tensor_model_parallel_group(),
                    cp_group=parallel_state.get_context_parallel_group(), head_chunk_bytes=3 * 29 * PADDED // tp,
                    **fields)
    return model.seen[0]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("cache_cp"))
    seen = {1: run_on_ranks(1, _stores, work, 1, 1, timeout=300),
            2: run_on_ranks(2, _stores, work, 2, 1, tp=1, timeout=300),
            4: run_on_ranks(4, _stores, work, 2, 2, tp=2, timeout=300)}
    return work, seen


def test_each_cp_rank_runs_megatrons_load_balanced_slice(stores):
    _, seen = stores
    assert seen[1] == [list(range(S))]
    c = S // 4
    assert seen[2] == [list(range(0, c)) + list(range(3 * c, 4 * c)), list(range(c, 3 * c))]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["cp2_tp1", "cp2_tp2"])
def test_cp_stores_equal_the_unsplit_store(stores, kind, layout):
    from megatron_kd_plugin.cache import TopKCacheReader

    work, _ = stores
    whole, split = TopKCacheReader(f"{work}/{kind}_cp1_tp1.zarr"), TopKCacheReader(f"{work}/{kind}_{layout}.zarr")
    for i in range(N):
        assert torch.equal(split[i].tokens, whole[i].tokens)
        assert torch.equal(split[i].teacher.ids, whole[i].teacher.ids), (kind, layout, i)
        torch.testing.assert_close(split[i].teacher.logprobs, whole[i].teacher.logprobs, rtol=0,
                                   atol=8e-6)      # TP's LSE combination: 2-3 fp32 ulps of an LSE ~20 (5.7e-6 seen)


def test_cp_refusals_are_one_line():
    import argparse

    from megatron_kd_plugin.commands.cache import check_cp

    args = argparse.Namespace(cp=2, seq_length=S + 2)
    for kind, cuda, fragment in (("hf", True, "--seq-length=18 is not a multiple of 2 x --cp = 4"),):
        with pytest.raises(ValueError, match=fragment):
            check_cp(args, kind, layout="stream", cuda=cuda)
    args.seq_length = S
    with pytest.raises(ValueError, match=r"^--cp=2: context parallelism needs a Hugging Face teacher \(a save_gpt"):
        check_cp(args, "save_gpt", layout="stream", cuda=True)
    with pytest.raises(ValueError, match=r"^--cp=2: context-parallel attention needs Transformer Engine on CUDA"):
        check_cp(args, "hf", layout="stream", cuda=False)
    for layout in ("packed", "document"):          # refused where a GPU would run it, before the teacher loads
        with pytest.raises(ValueError, match=rf"^--cp=2 with --layout {layout}: context parallelism with rows of "
                                             "several documents is not supported; cache them with --cp 1"):
            check_cp(args, "hf", layout=layout, cuda=True)
    check_cp(args, "hf", layout="stream", cuda=True)
