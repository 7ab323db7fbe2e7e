"""The memory planner (``python -m megatron_kd_plugin plan``): model state against Megatron-Bridge's estimator, the
activation table against every tensor megatron-core's local layers save (one spawned process, ~30 s), the recipes'
stated figures, margins and lengths, the published case, the refusals. The whole step against measured peaks:
tools/bench_step.py (docs/long-context.md)."""

from __future__ import annotations

import functools
import math
import re

import pytest
from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory

from megatron_kd_plugin.commands.plan import GIB, fits, main, plan_memory
from megatron_kd_plugin.recipes import RECIPES

ONE_GPU = "qwen3_8b_to_0p6b_kd_768k_1gpu_h200_bf16_config"
ONE_GPU_32K = "qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config"
EIGHT_GPU = "qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config"
H200_GIB = 140


def test_model_state_is_bridges_and_activations_follow_the_layer_table(qwen3_configs):
    """Weights, gradients and optimizer are Bridge's estimate split; the activations are the module docstring's
    Transformer Engine column (on CUDA) for Qwen3-1.7B (H=2048, 16 heads of 128, 8 groups, SwiGLU 6144, QK norms),
    restated here per token and layer: 2H + 2H norms, 3Hq + 3G attention, Hq QK norm, 3F MLP, in bf16; CP divides
    them, full recompute keeps one [s, b, H] input a layer instead."""
    cfg = RECIPES[EIGHT_GPU](hf_path=str(qwen3_configs["1.7b"]))
    cfg.data_parallel_size = 1
    estimate = estimate_training_memory(cfg)
    plan = plan_memory(cfg, gpus=8)
    assert plan.weights + plan.gradients + plan.optimizer == pytest.approx(estimate.weight_and_optimizer_bytes)
    m = cfg.model
    h, q, g, f = 2048, 16 * 128, 8 * 128, 6144
    assert (m.hidden_size, m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels,
            m.ffn_hidden_size, m.qk_layernorm) == (h, q, g, f, True)
    tokens = m.seq_length // 8
    per_token = 2 * (4 * h + 3 * q + 3 * g + q + 3 * f) + 4 * (2 + 16 + 16 + 8)
    outside = 8 + 2 * h * 2 + 4                                          # token ids, final norm, the loss's hidden
    assert plan.layers == "transformer_engine" and plan.activations == pytest.approx(
        tokens * (m.num_layers * per_token + outside))
    assert plan.backward == pytest.approx(tokens * 2 * max(2 * f, q + 2 * g))
    # Bridge's per-layer formula (18 H + 4 F bytes at bf16) was 0.81x this count for Qwen3-1.7B
    assert (18 * h + 4 * f) / per_token == pytest.approx(0.81, abs=0.01)
    cfg.model.context_parallel_size = 1
    assert plan_memory(cfg, gpus=1).activations == pytest.approx(8 * plan.activations)
    cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "uniform", 1
    full = plan_memory(cfg, gpus=1)
    assert full.activations == pytest.approx(8 * tokens * (m.num_layers * 2 * h + outside))
    assert full.backward == pytest.approx(8 * tokens * (per_token + 2 * max(2 * f, q + 2 * g)))


def _local_saved_bytes(cases):
    """For each (seq, batch, qk_norm): one forward of tools/bench_step.py's student (2 layers, H=32, 4 heads of 16 =
    64 > H, 2 groups, SwiGLU 48, fp32, CPU): bytes of every distinct non-parameter storage saved for backward, by
    layer ("outside": the rest)."""
    import types

    import torch

    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from tools.bench_step import _build_student

    seed_model_parallel(0)
    results = []
    for seq, batch, qk_norm in cases:
        args = types.SimpleNamespace(layers=2, hidden=32, heads=4, groups=2, kv_channels=16, ffn=48, vocab=96,
                                     qk_norm=qk_norm)
        model = _build_student(args, seq, torch.float32)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        where, saved = ["outside"], {}

        def leave(module, inputs, output):
            where.pop()

        for index, layer in enumerate(model.decoder.layers):
            layer.register_forward_pre_hook(lambda module, inputs, i=index: where.append(i))
            layer.register_forward_hook(leave)

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved.setdefault(storage.data_ptr(), (where[-1], storage.nbytes()))
            return tensor

        tokens = torch.randint(0, 96, (batch, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(tokens, torch.arange(seq).expand(batch, seq), None,
                  output_processor=lambda hidden_states, **_: hidden_states.sum(), output_processor_context={})
        totals = {}
        for place, nbytes in saved.values():
            totals[place] = totals.get(place, 0) + nbytes
        results.append(totals)
    return results


@pytest.mark.parametrize("student", ["tiny_hf_qwen3", "tiny_hf_gpt_oss"])
def test_the_planned_weights_count_the_checkpoints_parameters(student, request):
    """The plan's weights are the HF checkpoint's parameters (the safetensors' elements) within 2 %: Bridge's
    estimator leaves out biases, norms and sinks, and before ``estimate_model_state`` it counted gpt-oss's gated
    experts (a clamped activation, not SiLU) with two projections instead of three (18 % low)."""
    from safetensors import safe_open

    folder = request.getfixturevalue(student)
    elements = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as tensors:
            elements += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    cfg = RECIPES["hf_student_kd_cpu_fp32_config"](hf_path=str(folder), seq_length=16)
    plan = plan_memory(cfg, device="cpu")
    assert plan.weights / 4 == pytest.approx(elements, rel=0.02)


def test_local_layer_column_is_exactly_what_megatron_core_saves():
    """The module docstring's local column (CPU: torch's composite RMSNorm) against a count of every tensor
    megatron-core's local layers save for backward, with and without QK norms, at s x b = 24 x 2 and 40 x 1: equal to
    the byte, per layer and outside the layers."""
    from megatron_kd_plugin.commands.plan import (LayerShape, layer_bytes_per_sequence, layer_bytes_per_token,
                                                  outside_layers_bytes_per_token)
    from tests.distributed import run_on_ranks

    cases = [(seq, batch, qk_norm) for qk_norm in (False, True) for seq, batch in ((24, 2), (40, 1))]
    for (seq, batch, qk_norm), measured in zip(cases, run_on_ranks(1, _local_saved_bytes, cases)[0]):
        layer = LayerShape(hidden=32, heads=4, head_dim=16, groups=2, ffn=48, qk_norm=qk_norm, impl="local",
                           fused_norm=False)
        tokens = seq * batch
        for index in (0, 1):
            assert measured[index] == tokens * layer_bytes_per_token(layer, 4) + layer_bytes_per_sequence(
                layer, 4, seq), (seq, batch, qk_norm, index, measured)
        assert measured["outside"] == tokens * outside_layers_bytes_per_token(layer, 4, loss_keeps_hidden=False)


def _stated_gib(recipe) -> tuple[float, float]:
    """(GiB, margin in GiB to 90 % of an H200) as the recipe's docstring states them."""
    text = " ".join(recipe.__doc__.split())
    return (float(re.search(r"Planner: ([\d.]+) GiB", text).group(1)),
            float(re.search(r"margin ([\d.]+) GiB", text).group(1)))


def test_long_context_recipes_fit_an_h200_as_their_docstrings_state(qwen3_configs):
    """Each recipe's docstring states its planned GiB and its margin to the 90 % line; the one-GPU long-context one is
    the longest multiple of 128K that fits with >= 10 % of the H200 to spare (the planner's error on local layers)."""
    one = functools.partial(RECIPES[ONE_GPU], hf_path=str(qwen3_configs["0.6b"]))
    eight = functools.partial(RECIPES[EIGHT_GPU], hf_path=str(qwen3_configs["1.7b"]))
    short = functools.partial(RECIPES[ONE_GPU_32K], hf_path=str(qwen3_configs["0.6b"]))
    plans = {ONE_GPU: plan_memory(one(), gpus=1), EIGHT_GPU: plan_memory(eight(), gpus=8),
             ONE_GPU_32K: plan_memory(short(), gpus=1)}
    assert eight().model.seq_length >= 65536 and eight().model.context_parallel_size == 8
    for name, plan in plans.items():
        assert plan.impl == "fused" and fits(plan, H200_GIB), name
        stated, margin = _stated_gib(RECIPES[name])
        assert round(plan.total() / GIB, 1) == stated, name
        assert round(0.9 * H200_GIB - plan.total() / GIB, 1) == margin, name
    plan_one = plans[ONE_GPU]
    assert not fits(plan_one, H200_GIB, "forward_chunked") and not fits(plan_one, H200_GIB, "megatron_peer")
    assert plan_one.total() <= 0.8 * H200_GIB * GIB
    longer = one()
    longer.model.seq_length = longer.dataset.seq_length = longer.model.seq_length + 131072
    assert plan_memory(longer, gpus=1).total() > 0.8 * H200_GIB * GIB
    million = one()
    million.model.seq_length = million.dataset.seq_length = 1048576          # what it promised before the count
    assert not fits(plan_memory(million, gpus=1), H200_GIB)


def test_published_case_prints_dense_not_fitting_and_fused_fitting(capsys, qwen3_configs):
    assert main(["--published", "--hf-path", str(qwen3_configs["1.7b"])]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("GiB per GPU")).split()
    assert header[-4:] == ["fused", "forward_chunked", "megatron_peer", "dense"]
    total = [float(x) for x in next(line for line in out.splitlines() if line.startswith("total")).split()[-4:]]
    verdict = next(line for line in out.splitlines() if line.startswith("140 GiB GPU"))
    assert verdict.split("usable)")[1].split() == ["fits", "does", "NOT", "fit", "does", "NOT", "fit", "does",
                                                    "NOT", "fit"]
    assert "V=201,088" in out and "planned: seq_length=32,768, micro_batch_size=4 (one microbatch" in out
    assert total[0] < total[3] / 2 and total[0] < total[2] / 2
    assert "fused loss head is larger" not in out   # at real sizes it is the smallest: no note


def test_plan_takes_the_train_arguments_and_explains_a_larger_fused_head(capsys, tiny_hf_qwen3):
    """The CPU recipe at a small shape, with train's --hf-path, --seq-length and overrides: the plan is of the
    config train builds from them, says what it planned, and why the fused head is the larger one there."""
    from megatron_kd_plugin.commands.train import build_config

    arguments = ["--recipe", "hf_student_kd_cpu_fp32_config", "--hf-path", str(tiny_hf_qwen3), "--seq-length", "64",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "kd.chunk_bytes=8388608"]
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "planned: seq_length=64, micro_batch_size=2 (one microbatch in flight: 128 tokens), global_batch_size=4" in out
    plan = plan_memory(build_config("hf_student_kd_cpu_fp32_config", arguments[-3:], hf_path=str(tiny_hf_qwen3),
                                    seq_length=64), gpus=1)
    total = next(line for line in out.splitlines() if line.startswith("total")).split()[-4:]
    assert float(total[0]) == pytest.approx(plan.total("fused") / GIB, abs=0.006)
    assert plan.chunk_bytes == 8388608 and plan.loss_head["fused"] > plan.loss_head["forward_chunked"]
    note = next(line for line in out.splitlines() if "fused loss head is larger than" in line)
    assert "forward_chunked" in note and "c = 8 MiB" in note
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "the train command's" in " ".join(capsys.readouterr().out.split())


def test_plan_refuses_bad_input_with_one_line(capsys, qwen3_configs):
    with pytest.raises(SystemExit):
        main(["--recipe", ONE_GPU, "--gpu-memory", "0"])
    assert "--gpu-memory=0.0: must be > 0 GiB" in capsys.readouterr().err
    assert main(["--recipe", "no_such_recipe"]) == 2
    assert "unknown recipe 'no_such_recipe'" in capsys.readouterr().err
    assert main(["--recipe", EIGHT_GPU, "--hf-path", str(qwen3_configs["1.7b"]), "--gpus", "12"]) == 2
    assert "gpus=12 is not a multiple of TP x CP x PP = 8" in capsys.readouterr().err


def test_a_moe_student_at_an_expert_tp_megatron_refuses_gets_one_line_from_plan_and_train(capsys, tiny_hf_gpt_oss,
                                                                                          tmp_path):
    """gpt-oss's experts have biases, which megatron-core builds only at expert TP 1 (it asserts otherwise when the
    model is set up): plan and train say so in one line before anything is built."""
    from megatron_kd_plugin.commands import train

    arguments = ["--recipe", "hf_student_kd_cpu_fp32_config", "--hf-path", str(tiny_hf_gpt_oss), "--seq-length", "16",
                 f"dataset.cache_path={tmp_path / 'none.zarr'}", "model.expert_tensor_parallel_size=2"]
    for command in (main, train.main):
        assert command(arguments) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error: " in line]
        assert len(errors) == 1 and "expert_tensor_parallel=2: the model's experts have biases" in errors[0], errors
