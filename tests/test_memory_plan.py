"""The memory planner (``python -m megatron_kd_plugin plan``) against Megatron-Bridge's estimator, on the long-context
recipes and the published case (single process, no store, no model built)."""

from __future__ import annotations

import functools
import re

import pytest
from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory

from megatron_kd_plugin.commands.plan import GIB, fits, main, plan_memory
from megatron_kd_plugin.recipes import RECIPES

ONE_GPU = "qwen3_8b_to_0p6b_kd_1m_1gpu_h200_bf16_config"
EIGHT_GPU = "qwen3_8b_to_1p7b_kd_128k_8gpu_h200_bf16_config"
H200_GIB = 140


def test_plan_is_bridges_estimate_split_with_only_the_output_layer_term_replaced(qwen3_configs):
    cfg = RECIPES[EIGHT_GPU](hf_path=str(qwen3_configs["1.7b"]))
    cfg.data_parallel_size = 1
    estimate = estimate_training_memory(cfg)
    plan = plan_memory(cfg, gpus=8)
    assert plan.weights + plan.gradients + plan.optimizer == pytest.approx(estimate.weight_and_optimizer_bytes)
    m = cfg.model
    full_logits_term = m.seq_length * m.hidden_size * 4 * (1 + 151936 / m.hidden_size) / m.context_parallel_size
    assert plan.activations + full_logits_term == pytest.approx(estimate.activation.memory_bytes)
    # CP divides everything per token; full recompute keeps far less than selective
    cfg.model.context_parallel_size = 1
    assert plan_memory(cfg, gpus=1).activations == pytest.approx(8 * plan.activations)
    cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "uniform", 1
    assert plan_memory(cfg, gpus=1).activations < 0.2 * 8 * plan.activations


def _stated_gib(recipe) -> float:
    return float(re.search(r"Planner: ([\d.]+) GiB", " ".join(recipe.__doc__.split())).group(1))


def test_long_context_recipes_fit_an_h200_as_their_docstrings_state(qwen3_configs):
    one = functools.partial(RECIPES[ONE_GPU], hf_path=str(qwen3_configs["0.6b"]))
    eight = functools.partial(RECIPES[EIGHT_GPU], hf_path=str(qwen3_configs["1.7b"]))
    plan_one, plan_eight = plan_memory(one(), gpus=1), plan_memory(eight(), gpus=8)
    assert eight().model.seq_length >= 65536 and eight().model.context_parallel_size == 8
    for recipe, plan in ((RECIPES[ONE_GPU], plan_one), (RECIPES[EIGHT_GPU], plan_eight)):
        assert plan.impl == "fused" and fits(plan, H200_GIB)
        assert round(plan.total() / GIB, 1) == _stated_gib(recipe), recipe.__name__
    assert not fits(plan_one, H200_GIB, "forward_chunked") and not fits(plan_one, H200_GIB, "megatron_peer")
    longer = one()
    longer.model.seq_length = longer.dataset.seq_length = 2 * longer.model.seq_length
    assert not fits(plan_memory(longer, gpus=1), H200_GIB)       # the longest power of two that fits


def test_published_case_prints_dense_not_fitting_and_fused_fitting(capsys, qwen3_configs):
    assert main(["--published", "--hf-path", str(qwen3_configs["1.7b"])]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("GiB per GPU")).split()
    assert header[-4:] == ["fused", "forward_chunked", "megatron_peer", "dense"]
    total = [float(x) for x in next(line for line in out.splitlines() if line.startswith("total")).split()[1:]]
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
    total = next(line for line in out.splitlines() if line.startswith("total")).split()[1:]
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
