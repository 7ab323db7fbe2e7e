"""``kd_forward_step`` under megatron-core's DDP with the distributed optimizer and overlapped parameter gather.

DDP waits for a bucket's all-gather only in a forward pre-hook of the module owning its parameters; the KD output
processor reads the lm_head weight without calling ``output_layer``, so it must run that module's pre-hooks itself.
Two DP ranks over gloo train the same tiny GPTModel (untied lm_head, buckets of a few parameters) for a few
iterations the way Bridge's loop does (pre-hooks off for iteration 1, on after it), once with
``overlap_param_gather`` and once without: losses and parameters must be equal. One spawn (56 s wall at load 13).
"""

from __future__ import annotations

import types

import torch

VOCAB, SEQ, BATCH, K, ITERATIONS = 64, 16, 2, 4, 4


def _batch(generator):
    """A batch-first ``KDRow`` of random tokens and a random top-K teacher."""
    from megatron_kd_plugin.cache import KDRow
    from megatron_kd_plugin.loss import TopKTeacher

    logprobs = torch.log_softmax(torch.randn(BATCH, SEQ, K, generator=generator), -1) - 0.5   # top-K mass < 1
    ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:K] for _ in range(BATCH * SEQ)])
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return KDRow(tokens, labels, torch.ones(BATCH, SEQ), torch.arange(SEQ).expand(BATCH, SEQ),
                 TopKTeacher(ids.view(BATCH, SEQ, K).int(), logprobs))


def _train(overlap_param_gather: bool) -> dict:
    """ITERATIONS Bridge-style steps of a DDP + distributed-optimizer GPTModel driven by ``kd_forward_step``."""
    from megatron.bridge.training.config import RerunStateMachineConfig
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megatron_kd_plugin.loss import KDLossOptions
    from megatron_kd_plugin.bridge.forward_step import kd_forward_step
    from megatron_kd_plugin.cpu_compat import megatron_optimizer_on_cpu, seed_model_parallel

    seed_model_parallel(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               overlap_param_gather=overlap_param_gather, bucket_size=2000)
    with megatron_optimizer_on_cpu():
        ddp = DistributedDataParallel(config, ddp_config, model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                           use_distributed_optimizer=True), [ddp])
    state = types.SimpleNamespace(cfg=types.SimpleNamespace(kd=KDLossOptions(),
                                                            rerun_state_machine=RerunStateMachineConfig()))
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    if overlap_param_gather:   # Bridge: hooks off for the first iteration, on once a step has run
        ddp.disable_forward_pre_hook(param_sync=False)
    losses = []
    for iteration in range(ITERATIONS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        output, loss_func = kd_forward_step(state, iter([_batch(generator)]), ddp)
        loss_sum, num_tokens, _ = loss_func(output)
        (loss_sum / num_tokens).backward()
        ddp.finish_grad_sync()
        with megatron_optimizer_on_cpu():
            optimizer.step()
        losses.append(float(loss_sum / num_tokens))
        if overlap_param_gather and iteration == 0:
            ddp.enable_forward_pre_hook()
    if overlap_param_gather:
        ddp.disable_forward_pre_hook(param_sync=True)   # gathers the last step's update, as Bridge does at the end
    return {"losses": losses, "buckets": len(ddp.bucket_groups),
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _overlap_and_plain():
    return _train(overlap_param_gather=True), _train(overlap_param_gather=False)


def test_overlapped_param_gather_trains_like_no_overlap():
    from tests.distributed import run_on_ranks

    for overlap, plain in run_on_ranks(2, _overlap_and_plain, tp=1):
        assert overlap["buckets"] > 2   # the output layer's bucket is not the only one
        assert len(overlap["losses"]) == ITERATIONS
        torch.testing.assert_close(torch.tensor(overlap["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
        assert plain["params"].keys() == overlap["params"].keys()
        for name, value in plain["params"].items():
            torch.testing.assert_close(overlap["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
