"""The CPU test harness itself, and real megatron-core tensor parallelism on it (GPTModel at TP=1/2/4)."""

import functools

import pytest
import torch

from tests.distributed import run_on_ranks

VOCAB, SEQ, BATCH = 96, 16, 2


def _rank_and_group_size():
    import torch.distributed as dist
    from megatron.core import parallel_state

    return dist.get_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank one")
    return "ok"


def test_harness_runs_every_rank_with_megatron_tp():
    assert run_on_ranks(2, _rank_and_group_size) == [(0, 2), (1, 2)]


def test_harness_reports_the_failing_rank_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 ---.*deliberate failure on rank one"):
        run_on_ranks(2, _fail_on_rank_one, timeout=60)


def _gpt_forward_backward(seed):
    """Build a tiny GPTModel at this TP size, run forward+backward; return full-vocab logits and a few grads."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer import TransformerConfig

    from megatron_kd_plugin.cpu_compat import seed_model_parallel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    seed_model_parallel(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ, parallel_output=True)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    causal_mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    local_logits = model(tokens, position_ids, causal_mask)  # [b, s, V/tp]
    logits = gather_from_tensor_model_parallel_region(local_logits)  # [b, s, V]
    logits.float().logsumexp(-1).sum().backward()
    embedding_grad = gather_from_tensor_model_parallel_region(
        model.embedding.word_embeddings.weight.grad.t().contiguous()).t()  # [V, h]
    return logits.detach(), embedding_grad, model.decoder.final_layernorm.weight.grad.clone()


@functools.cache
def _single_rank_reference():
    (reference,) = run_on_ranks(1, _gpt_forward_backward, 7)
    return reference


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_model_tensor_parallel_matches_single_rank(tp):
    logits_1, embedding_grad_1, norm_grad_1 = _single_rank_reference()
    for logits, embedding_grad, norm_grad in run_on_ranks(tp, _gpt_forward_backward, 7):
        torch.testing.assert_close(logits, logits_1, rtol=0, atol=1e-5)
        torch.testing.assert_close(embedding_grad, embedding_grad_1, rtol=0, atol=1e-5)
        torch.testing.assert_close(norm_grad, norm_grad_1, rtol=0, atol=1e-5)
    assert logits_1.shape == (BATCH, SEQ, VOCAB)


def test_megatron_builds_its_own_attention_masks_on_cpu():
    """megatron-core builds a sliding-window mask itself (gpt-oss's windowed layers ignore the mask passed in) with a
    literal device="cuda"; with the CPU work-arounds it is a CPU tensor: True where query i may not see key j, i.e.
    outside j in [i - left, i + right] (the band written independently here), on square and rectangular grids."""
    from megatron.core.fusions import fused_softmax

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds

    apply_cpu_workarounds()
    for sq, skv, window in ((7, 7, (2, 0)), (5, 9, (3, 0)), (6, 6, (1, 1))):
        mask = fused_softmax.get_sliding_window_causal_mask(sq, skv, window)
        query = torch.arange(sq).view(-1, 1) + (skv - sq)                     # queries are the last sq keys
        key = torch.arange(skv).view(1, -1)
        visible = (key >= query - window[0]) & (key <= query + window[1])
        assert mask.device.type == "cpu" and torch.equal(mask, ~visible), (sq, skv, window)
    causal = fused_softmax.get_default_causal_mask(5)
    assert causal.device.type == "cpu" and torch.equal(causal, torch.ones(5, 5, dtype=torch.bool).triu(1))
