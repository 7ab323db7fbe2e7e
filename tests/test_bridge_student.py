"""The student path: a HF student in, KD on CPU from a cache of a HF teacher, checkpoint/resume, HF student out.

One spawn of two ranks at TP=2 (73 s wall at load 13): the cache is written by two DP writers from transformers'
logits of the tiny HF teacher; the Qwen3 recipe takes a 1-layer HF student (``hf_path``); its first training loss
equals the float64 KD loss of the *HF student's own* logits (``checkpoint.pretrained_checkpoint`` loaded); a run
stopped at ``train.exit_interval=2`` and resumed from ``checkpoint.load`` equals the uninterrupted run (losses, parameters);
the healed student exported by the checkpoint (``iter_*/hf``) gives, under transformers, the Megatron student's
logits. Plus single-process checks of the config fixes (tokenizer vocabulary, NaN check, YAML kd section, the
pretrain import) and the bad-input errors.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from unittest import mock

import numpy as np
import pytest
import torch

RECIPE = "qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config"
VOCAB, SEQ, SAMPLES, K, STEPS = 1000, 32, 8, 16, 4


def student_overrides(store, run_dir, *extra) -> list[str]:
    """The Qwen3 recipe shrunk to a CPU run: seq 32, fp32, TP=2, 4 steps of 2 microbatches of 2 rows."""
    return [f"dataset.cache_path={store}", f"dataset.k={K}", f"model.seq_length={SEQ}", f"dataset.seq_length={SEQ}",
            "model.tensor_model_parallel_size=2", "model.recompute_granularity=null", "mixed_precision=null",
            f"train.train_iters={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2",
            "optimizer.lr=3e-3", "optimizer.min_lr=3e-3", "scheduler.lr_warmup_iters=0",
            "scheduler.lr_decay_style=constant", "dataset.num_workers=0", f"logger.tensorboard_dir={run_dir}/tb",
            "checkpoint.save=null", "checkpoint.load=null", *extra]


def write_hf_teacher_cache(teacher, store) -> None:
    """The top-K cache of the HF teacher's logits (transformers' forward), two DP writers."""
    import torch.distributed as dist

    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.writer import write_cache
    from tests.hf_models import hf_logits

    def content() -> str:                       # records which ranks scan the source (issue 37: rank 0 only)
        with open(pathlib.Path(store).with_name("scanned"), "a") as f:
            f.write(str(dist.get_rank()))
        return "test-student"

    stream = np.random.default_rng(0).integers(0, VOCAB, size=SAMPLES * SEQ + 1)
    source = TokenWindows(stream, SEQ, num_samples=SAMPLES, fingerprint=content, tokenizer="synthetic",
                          tokenizer_vocab_size=VOCAB)
    write_cache(source, lambda tokens, position_ids: hf_logits(teacher, tokens).float().transpose(0, 1), store, k=K,
                vocab_size=VOCAB, teacher="tiny-hf-qwen3", samples_per_shard=2, dp_rank=dist.get_rank(),
                dp_size=dist.get_world_size(), progress=False)


def megatron_logits(model, tokens) -> torch.Tensor:
    """Full-vocabulary float64 logits [b, s, V] of a TP-sharded GPTModel (shards gathered over TP)."""
    from megatron.core import parallel_state

    from tests.test_bridge_train import causal_mask

    with torch.no_grad():
        local = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), causal_mask(tokens.shape[1]))
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1).double()


def first_step_reference(cfg, student) -> float:
    """The first step's loss from the HF student's own float64 logits: mean over the 2 microbatches of the recipe's
    KD term per token (``cfg.kd``: tail, divergence, temperature, alpha = 1, from the loss's float64 definition), on
    the dataset's first 4 rows (what a 1-rank-DP run reads first)."""
    from tests.hf_models import hf_logits
    from tests.test_bridge_train import fixed_batch
    from tests.test_loss_helpers import token_kd_from_definition

    kd = cfg.kd
    assert kd.alpha == 1.0, "the reference is the KD term alone"
    batch = fixed_batch(cfg, rows=4)
    losses = []
    for rows in (slice(0, 2), slice(2, 4)):
        logits = hf_logits(student, batch.tokens[rows]).double()                         # [b, s, V]
        ids, log_p = batch.teacher.ids[rows].long(), batch.teacher.logprobs[rows].double()
        terms = [token_kd_from_definition(logits[b, s], ids[b, s], log_p[b, s], kd.tail, kd.divergence,
                                          kd.temperature, kd.jsd_beta)[0]
                 for b in range(logits.shape[0]) for s in range(logits.shape[1])]
        losses.append(float(torch.stack(terms).mean()) * kd.temperature ** 2)
    return sum(losses) / 2


def student_body(teacher, student, small_student, tmp):
    from megatron_kd_plugin.bridge.config import check_kd_config
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.commands.train import build_config
    from tests.hf_models import hf_logits
    from tests.test_bridge_train import gathered_parameters

    store, ckpt = tmp / "teacher.zarr", tmp / "ckpt"
    write_hf_teacher_cache(teacher, store)

    def run(*extra):
        cfg = build_config(RECIPE, student_overrides(store, tmp, *extra), hf_path=str(student))
        models, history = train_on_cpu(cfg, progress=False)
        return cfg, models[0], history

    cfg, uninterrupted, history = run()
    reference = first_step_reference(cfg, student)
    _, _, first_half = run(f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", "train.exit_interval=2")
    _, resumed, second_half = run(f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}")
    tokens = torch.from_numpy(np.random.default_rng(1).integers(0, VOCAB, size=(2, SEQ)))
    megatron = megatron_logits(resumed, tokens)[..., :VOCAB]
    exported = ckpt / "iter_0000004" / "hf"
    try:
        build_config(RECIPE, student_overrides(store, tmp), hf_path=str(small_student))
        check_kd_config(build_config(RECIPE, student_overrides(store, tmp), hf_path=str(small_student)))
        small_vocab_error = "accepted"
    except ValueError as error:
        small_vocab_error = str(error)
    return {"history": history, "reference": reference, "resumed history": first_half + second_half,
            "params": gathered_parameters(uninterrupted), "resumed params": gathered_parameters(resumed),
            "megatron": megatron, "exported": hf_logits(exported, tokens), "original": hf_logits(student, tokens),
            "exported files": sorted(p.name for p in exported.iterdir()), "small vocab": small_vocab_error,
            "scanned": (tmp / "scanned").read_text()}


@pytest.fixture(scope="module")
def student_run(tiny_hf_qwen3, tmp_path_factory):
    from tests.distributed import run_on_ranks
    from tests.hf_models import save_tiny_causal_lm

    tmp = tmp_path_factory.mktemp("student")
    student = save_tiny_causal_lm(tmp / "student", "qwen3", vocab_size=VOCAB, num_hidden_layers=1, seed=3)
    small = save_tiny_causal_lm(tmp / "small", "qwen3", vocab_size=500, num_hidden_layers=1, seed=4)
    return run_on_ranks(2, student_body, tiny_hf_qwen3, student, small, tmp, timeout=600)


def test_the_cache_writers_scan_their_source_once_on_rank_0(student_run):
    """Issue 37: the fingerprint and token range of the source (one pass over its files) are computed on global rank
    0 alone and handed to the other writer ranks."""
    assert [rank["scanned"] for rank in student_run] == ["0", "0"]


def test_hf_student_starts_from_its_weights_and_learns(student_run):
    for rank in student_run:
        kd = [row["kd loss"] for row in rank["history"]]
        assert len(kd) == STEPS and kd[-1] < kd[0], kd
        # step 0's loss is that of the HF student's own weights (pretrained_checkpoint), in float64
        assert math.isclose(rank["history"][0]["loss"], rank["reference"], rel_tol=1e-5), \
            (rank["history"][0]["loss"], rank["reference"])


def test_run_resumed_after_step_2_equals_the_uninterrupted_run(student_run):
    for rank in student_run:
        resumed, straight = rank["resumed history"], rank["history"]
        assert [row["step"] for row in resumed] == list(range(STEPS))
        for a, b in zip(straight, resumed):
            for key in ("loss", "kd loss", "grad norm", "lr"):
                assert math.isclose(a[key], b[key], rel_tol=1e-6), (key, a, b)
        for name, value in rank["params"].items():
            torch.testing.assert_close(rank["resumed params"][name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_exported_hf_student_gives_the_megatron_students_logits(student_run):
    rank = student_run[0]
    assert "config.json" in rank["exported files"] and any(n.endswith(".safetensors") for n in rank["exported files"])
    torch.testing.assert_close(rank["exported"], rank["megatron"], rtol=1e-5, atol=2e-5)
    assert (rank["exported"] - rank["original"]).abs().max() > 1e-3   # the export is the trained student


def test_student_vocabulary_smaller_than_the_teacher_ids_is_refused(student_run):
    assert "500" in student_run[0]["small vocab"], student_run[0]["small vocab"]


# ---- single process: the config fixes and the bad-input errors ----

def _validated(cfg, world_size: int = 1):
    """Bridge's ``runtime_config_update`` at ``world_size`` with the store check skipped (no store here)."""
    import megatron.bridge.training.config as bridge_config
    from megatron.bridge.training.config import runtime_config_update

    import megatron_kd_plugin.bridge.config as kd_config

    with mock.patch.object(bridge_config, "get_world_size_safe", lambda: world_size), \
            mock.patch.object(kd_config, "check_kd_config", lambda cfg: None):
        runtime_config_update(cfg)
    return cfg


def test_model_vocab_override_below_the_recipes_fits_bridges_tokenizer_check(tiny_hf_qwen3):
    """Bridge's setup (training/setup.py, _validate_and_set_vocab_size) refuses a model vocabulary smaller than
    the tokenizer it builds from ``cfg.tokenizer``."""
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    from megatron_kd_plugin.commands.train import build_config

    for recipe, overrides, hf_path in (("tiny_gpt_kd_cpu_fp32_config", ["model.vocab_size=200"], None),
                                       (RECIPE, ["model.vocab_size=600"], str(tiny_hf_qwen3))):
        cfg = _validated(build_config(recipe, overrides, hf_path=hf_path))
        assert build_tokenizer(cfg.tokenizer).vocab_size <= cfg.model.vocab_size, recipe


def test_nan_or_inf_loss_stops_the_step_and_recipes_check_gradients(tiny_hf_qwen3):
    from megatron_kd_plugin.bridge.forward_step import kd_loss_func
    from megatron_kd_plugin.commands.train import build_config
    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds
    from megatron_kd_plugin.loss import KDLossResult

    apply_cpu_workarounds()   # the rerun state machine names the device in its message

    def result(value):
        one = torch.tensor(1.0)
        return KDLossResult(torch.tensor(value), torch.tensor(3), {"kd loss": torch.stack([one, one])})

    for bad, name in ((float("nan"), "NaN"), (float("inf"), "Inf")):
        with pytest.raises(RuntimeError, match=f"found {name} in local forward KD loss"):
            kd_loss_func(result(bad))
        assert not math.isfinite(kd_loss_func(result(bad), check_for_nan_in_loss=False)[0])
    assert float(kd_loss_func(result(2.0))[0]) == 2.0
    for recipe, hf_path in (("tiny_gpt_kd_cpu_fp32_config", None), (RECIPE, str(tiny_hf_qwen3))):
        cfg = build_config(recipe, [], hf_path=hf_path)
        assert cfg.ddp.check_for_nan_in_grad and cfg.rerun_state_machine.check_for_nan_in_loss, recipe


def test_bridge_configcontainer_from_yaml_refuses_a_kd_yaml_instead_of_dropping_kd(tmp_path):
    from megatron.bridge.training.config import ConfigContainer

    from megatron_kd_plugin.bridge import register
    from megatron_kd_plugin.bridge.config import KDConfigContainer
    from megatron_kd_plugin.commands.train import build_config

    register()
    build_config("tiny_gpt_kd_cpu_fp32_config", ["kd.temperature=3.0"]).to_yaml(str(tmp_path / "kd.yaml"))
    with pytest.raises(Exception, match="without its kd section"):
        ConfigContainer.from_yaml(str(tmp_path / "kd.yaml"))
    assert KDConfigContainer.from_yaml(str(tmp_path / "kd.yaml")).kd.temperature == 3.0


def test_gpu_launch_checks_the_pretrain_import_before_building_anything(capsys):
    """Here Bridge's pretrain() cannot import (no nvidia-resiliency-ext): with CUDA claimed, the command says what
    to install and never builds the config."""
    from megatron_kd_plugin.commands import train

    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch.object(train, "build_config", side_effect=AssertionError("built before the check")):
        assert train.main(["--recipe", "tiny_gpt_kd_cpu_fp32_config"]) == 2
    error = capsys.readouterr().err
    assert "nvidia_resiliency_ext" in error and "nvidia-resiliency-ext" in error and "[gpu]" in error, error


def test_bad_student_folder_and_parallel_sizes_are_refused_before_step_one(tiny_hf_qwen3, tmp_path, capsys,
                                                                          monkeypatch):
    from megatron_kd_plugin.commands.train import build_config, main

    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_qwen3, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM"):
        build_config(RECIPE, [], hf_path=str(bad))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--recipe", "tiny_gpt_kd_cpu_fp32_config", "model.tensor_model_parallel_size=4"]) == 2
    error = capsys.readouterr().err
    assert "model.tensor_model_parallel_size=4" in error and "does not divide the world size 2" in error, error
    with pytest.raises(ValueError, match="takes no hf_path"):
        build_config("tiny_gpt_kd_cpu_fp32_config", [], hf_path=str(tiny_hf_qwen3))
