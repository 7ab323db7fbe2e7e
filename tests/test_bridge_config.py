"""Recipes, overrides, the KD config section and Bridge registration (single process, no store needed)."""

from __future__ import annotations

import inspect
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from megatron.bridge.training.utils.omegaconf_utils import OverridesError

from megatron_kd_plugin.bridge.config import KDConfigContainer
from megatron_kd_plugin.bridge.provider import TopKCacheDatasetProvider
from megatron_kd_plugin.loss.options import KDLossOptions, check_training_options
from megatron_kd_plugin.recipes import RECIPES
from megatron_kd_plugin.commands.train import build_config
from tests.distributed import scaled

REPO = pathlib.Path(__file__).resolve().parent.parent
RECIPE_NAME = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)*_kd_(\w+_)?(\d+gpu_h200_bf16|cpu_fp32)_config$")


def recipe_config(name, hf_student):
    """The recipe's config; one taking a HF student (``hf_path``, default: a hub id) gets the local tiny one."""
    recipe = RECIPES[name]
    takes_hf = "hf_path" in inspect.signature(recipe).parameters
    return recipe(hf_path=str(hf_student)) if takes_hf else recipe()


def test_every_recipe_is_a_kd_config_with_a_conventional_name(tiny_hf_qwen3):
    assert len(RECIPES) >= 3
    for name in RECIPES:
        assert RECIPE_NAME.match(name), name
        cfg = recipe_config(name, tiny_hf_qwen3)
        assert isinstance(cfg, KDConfigContainer), name
        assert isinstance(cfg.dataset, TopKCacheDatasetProvider), name
        assert type(cfg.kd) is KDLossOptions, name
        assert cfg.dataset.seq_length == cfg.model.seq_length, name
        cfg.kd.check()
        if cfg.dataset.student_tokenizer is None:      # what check_kd_config warns about: nothing in a recipe
            heal = cfg.checkpoint.pretrained_checkpoint is not None
            assert check_training_options(cfg.kd, heal=heal) == [], name


def test_real_model_recipes_are_32k_bf16_hf_students_and_the_multi_gpu_one_uses_tp_pp_dp(tiny_hf_qwen3):
    one = recipe_config("qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config", tiny_hf_qwen3)
    eight = recipe_config("qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config", tiny_hf_qwen3)
    hf_config = json.loads((tiny_hf_qwen3 / "config.json").read_text())
    for cfg in (one, eight):
        assert cfg.model.seq_length == 32768 and cfg.mixed_precision == "bf16_mixed"
        # the architecture is the HF checkpoint's (AutoBridge), and training starts from its weights
        assert (cfg.model.vocab_size, cfg.model.num_layers, cfg.model.hidden_size) == (
            hf_config["vocab_size"], hf_config["num_hidden_layers"], hf_config["hidden_size"])
        assert cfg.checkpoint.pretrained_checkpoint == str(tiny_hf_qwen3) and cfg.checkpoint.also_save_hf_checkpoint
        assert cfg.checkpoint.load == cfg.checkpoint.save   # auto-resume
    assert (one.model.tensor_model_parallel_size, one.model.pipeline_model_parallel_size) == (1, 1)
    tp, pp = eight.model.tensor_model_parallel_size, eight.model.pipeline_model_parallel_size
    assert tp > 1 and pp > 1 and 8 // (tp * pp) > 1 and eight.model.sequence_parallel


def test_cpu_recipe_for_hf_students_is_fp32_without_gpu_settings_at_the_given_seq_length(tiny_hf_qwen3):
    assert {"tiny_gpt_kd_cpu_fp32_config", "hf_student_kd_cpu_fp32_config"} <= set(RECIPES)   # listed with the others
    cfg = RECIPES["hf_student_kd_cpu_fp32_config"](hf_path=str(tiny_hf_qwen3), seq_length=48)
    assert cfg.model.seq_length == cfg.dataset.seq_length == 48
    assert cfg.mixed_precision is None and not cfg.model.bf16 and not cfg.optimizer.bf16
    assert cfg.model.params_dtype == torch.float32 and cfg.model.recompute_granularity is None
    assert cfg.dataset.num_workers == 0 and not cfg.optimizer.use_distributed_optimizer
    assert cfg.checkpoint.pretrained_checkpoint == str(tiny_hf_qwen3) and cfg.checkpoint.also_save_hf_checkpoint
    # --seq-length: the recipe's argument, or for a recipe without one both seq_length overrides
    assert build_config("hf_student_kd_cpu_fp32_config", [], hf_path=str(tiny_hf_qwen3),
                        seq_length=64).dataset.seq_length == 64
    tiny = build_config("tiny_gpt_kd_cpu_fp32_config", [], seq_length=16)
    assert tiny.model.seq_length == tiny.dataset.seq_length == 16
    for name in ("qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config", "qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config"):
        gpu = recipe_config(name, tiny_hf_qwen3)   # the H200 recipes keep their GPU settings
        assert gpu.mixed_precision == "bf16_mixed" and gpu.model.recompute_granularity == "selective", name


def test_a_default_student_that_is_an_unreachable_hub_id_is_one_line(capsys, monkeypatch, tmp_path):
    """No --hf-path and no network (the hub offline, an empty cache): plan and train say what to do in one line."""
    import huggingface_hub.constants

    from megatron_kd_plugin.commands import plan, train

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    for command in (plan.main, train.main):
        assert command(["--recipe", "qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert ("its default student 'Qwen/Qwen3-0.6B' is a Hugging Face hub id and could not be fetched" in lines[0]
                and lines[0].endswith("--hf-path takes a local folder (config.json + *.safetensors)")), lines
    # a hub id given with --hf-path: the same line, about that id
    assert train.main(["--recipe", "hf_student_kd_cpu_fp32_config", "--hf-path", "someone/pruned-model"]) == 2
    line = capsys.readouterr().err.strip()
    assert "'someone/pruned-model' is not a local folder" in line and "--hf-path takes a local folder" in line


def test_the_kd_section_is_the_loss_options_checked_again_after_overrides():
    """cfg.kd is the loss's own KDLossOptions (one declaration of every option); Bridge's overrides set it field by
    field, and ``check()`` (which check_kd_config runs before step one) refuses a bad value set that way."""
    cfg = build_config("tiny_gpt_kd_cpu_fp32_config", ["kd.token_weight=1.5"])
    assert type(cfg.kd) is KDLossOptions and cfg.kd.token_weight == 1.5
    with pytest.raises(ValueError, match="token_weight=1.5: expected 0 <= token_weight <= 1"):
        cfg.kd.check()


def test_overrides_reach_every_section_and_bad_ones_fail_before_training():
    cfg = build_config("tiny_gpt_kd_cpu_fp32_config",
                       ["kd.temperature=2.0", "kd.tail=renorm", "train.train_iters=7", "dataset.seq_length=16",
                        "model.hidden_size=32"])
    assert (cfg.kd.temperature, cfg.kd.tail, cfg.train.train_iters) == (2.0, "renorm", 7)
    assert (cfg.dataset.seq_length, cfg.model.hidden_size) == (16, 32)
    assert isinstance(cfg.kd, KDLossOptions)
    with pytest.raises(OverridesError, match="nonexistent"):
        build_config("tiny_gpt_kd_cpu_fp32_config", ["train.nonexistent=1"])
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        build_config("nope", [])
    bad = build_config("tiny_gpt_kd_cpu_fp32_config", ["kd.tail=bogus"])
    with pytest.raises(ValueError, match="bogus"):
        bad.kd.check()


def test_yaml_config_naming_plugin_targets_fails_before_register_and_loads_after(tmp_path):
    """A fresh interpreter: registration is process-global, so 'before' needs a process that never registered."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
        from megatron_kd_plugin.bridge.config import KDConfigContainer
        from megatron_kd_plugin.recipes import RECIPES

        cfg = process_config_with_overrides(RECIPES["tiny_gpt_kd_cpu_fp32_config"](),
                                            cli_overrides=["kd.temperature=3.0", "dataset.cache_path=/x.zarr"])
        cfg.to_yaml({str(tmp_path / "kd.yaml")!r})
        try:
            KDConfigContainer.from_yaml({str(tmp_path / "kd.yaml")!r})
        except Exception as error:
            assert "allowlist" in str(error), error
            print("BEFORE: refused")
        else:
            raise SystemExit("loaded without registration")
        from megatron_kd_plugin.bridge import register
        register()
        register()
        loaded = KDConfigContainer.from_yaml({str(tmp_path / "kd.yaml")!r})
        assert type(loaded).__name__ == "KDConfigContainer", type(loaded)
        assert type(loaded.dataset).__name__ == "TopKCacheDatasetProvider", type(loaded.dataset)
        assert loaded.kd.temperature == 3.0 and loaded.dataset.cache_path == "/x.zarr"
        assert loaded.model.num_layers == cfg.model.num_layers
        print("AFTER: loaded")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=scaled(600))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BEFORE: refused" in done.stdout and "AFTER: loaded" in done.stdout


def test_launcher_lists_recipes_and_refuses_bad_input_with_a_message(capsys):
    from megatron_kd_plugin.commands.train import main

    assert main(["--list"]) == 0
    assert set(capsys.readouterr().out.split()) == set(RECIPES)
    assert main(["--recipe", "tiny_gpt_kd_cpu_fp32_config", "train.bogus=1"]) == 2
    assert "train.bogus" in capsys.readouterr().err
    assert main(["--recipe", "tiny_gpt_kd_cpu_fp32_config", "dataset.cache_path=/nonexistent.zarr"]) == 2
    assert "not a teacher cache" in capsys.readouterr().err
    assert main([]) == 2
