"""The KD recipe trained on CPU from a cache written by the cache tool: TP=2 == TP=1 step for step, loss falls,
the forward step's loss equals a float64 recomputation from GPTModel's logits, one store serves ablations.

Two spawned calls (~1 min in all): one rank writes the cache from a tiny teacher with ``write_cache`` and runs every
TP=1 training; two ranks train the same recipe at TP=2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.distributed import scaled

VOCAB, SEQ, SAMPLES, K = 256, 32, 16, 8
STEPS = 4


def causal_mask(s: int) -> torch.Tensor:
    """[1, 1, s, s], True = masked (megatron-core's default mask would be allocated on "cuda")."""
    return torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def tiny_overrides(store, *extra: str) -> list[str]:
    return [f"dataset.cache_path={store}", f"model.vocab_size={VOCAB}", f"model.seq_length={SEQ}",
            f"dataset.seq_length={SEQ}", f"dataset.k={K}", f"train.train_iters={STEPS}", *extra]


def write_teacher_cache(store, **options) -> None:
    """A 2-layer random teacher (megatron-core GPTModel, TP=1) cached with the cache tool's ``write_cache``
    (``options``: e.g. the sampled mode's)."""
    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.writer import write_cache
    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron_kd_plugin.commands.train import build_config

    teacher_cfg = build_config("tiny_gpt_kd_cpu_fp32_config",
                               tiny_overrides(store, "model.hidden_size=96", "model.init_method_std=0.25"))
    teacher_cfg.model.finalize()
    seed_model_parallel(7)
    teacher = teacher_cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    teacher.eval()
    # a stream with structure (repeated phrases) the teacher's attention can pick up, plus noise
    rng = np.random.default_rng(0)
    phrases = rng.integers(0, VOCAB, size=(12, 8))
    stream = np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=SAMPLES * SEQ // 8 + 1)])
    source = TokenWindows(stream, SEQ, num_samples=SAMPLES, fingerprint="test-bridge", tokenizer="synthetic",
                          tokenizer_vocab_size=VOCAB)

    def logits_fn(tokens, position_ids):                                    # [b, s] -> [s, b, V], stream rows
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return teacher(tokens, positions, causal_mask(tokens.shape[1])).transpose(0, 1)           # GPTModel gives [b, s, V]

    write_cache(source, logits_fn, store, **(dict(k=K) | options), vocab_size=VOCAB, teacher="tiny-random-gpt",
                samples_per_shard=4, progress=False)


def gathered_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter at full size: TP shards concatenated along their partition dim over the TP group."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    full = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(tp)]
            torch.distributed.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts, dim=param.partition_dim)
        full[name] = value.clone()
    return full


def train(store, *extra: str):
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.commands.train import build_config

    models, history = train_on_cpu(build_config("tiny_gpt_kd_cpu_fp32_config", tiny_overrides(store, *extra)),
                                   progress=False)
    return models[0], history


def manual_ghost_kl(model, batch) -> tuple[float, int]:
    """Forward KL with the ghost tail, summed over tokens, in float64 from GPTModel's own [b, s, V] logits."""
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, causal_mask(batch.tokens.shape[1])).double()     # [b, s, V]
    log_q = torch.log_softmax(logits, dim=-1)
    ids, log_p = batch.teacher.ids.long(), batch.teacher.logprobs.double()   # [b, s, K]
    p = log_p.exp()
    m, s = p.sum(-1), log_q.gather(-1, ids).exp().sum(-1)
    kl = (p * (log_p - log_q.gather(-1, ids))).sum(-1) + (1 - m) * (torch.log1p(-m) - torch.log1p(-s))
    return float((kl * batch.loss_mask).sum()), int(batch.loss_mask.sum())


def manual_sampled_kl(model, batch) -> float:
    """The sampled tail's f = Σ_k w_k (l_k − log Q_{I_k}) summed over tokens, float64 from the model's logits."""
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, causal_mask(batch.tokens.shape[1])).double()
    log_q = torch.log_softmax(logits, dim=-1).gather(-1, batch.teacher.ids.long())            # [b, s, N]
    weights = batch.teacher.weights.double()
    return float(((weights * (batch.teacher.logprobs.double() - log_q)).sum(-1) * batch.loss_mask).sum())


def sampled_store_step(sampled_store, topk_store, reference_model) -> dict:
    """A sampled store (N=12, t=1.5) of the same teacher: dataset rows carry the weights, the forward step's loss
    equals the float64 sampled KL, a training step runs, and tail/store mismatches are refused."""
    from megatron.bridge.data.base import DatasetBuildContext

    from megatron_kd_plugin.bridge.config import check_kd_config
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.commands.train import build_config

    n = 12
    write_teacher_cache(sampled_store, k=n, mode="sampled", proposal_temperature=1.5, sample_seed=2)
    cfg = build_config("tiny_gpt_kd_cpu_fp32_config", tiny_overrides(sampled_store, f"dataset.k={n}",
                                                                     "kd.tail=sampled"))
    cfg.model.finalize()
    check_kd_config(cfg)
    batch = fixed_batch(cfg)
    dataset = cfg.dataset.build_datasets(DatasetBuildContext(train_samples=1, valid_samples=0, test_samples=0))[0]
    sample, window = dataset.window_of(0)
    weights = TopKCacheReader(sampled_store)[sample].teacher.weights[window * SEQ:(window + 1) * SEQ]
    loss_sum, num_tokens, report = forward_step_loss(cfg, reference_model, batch)
    _, history = train(sampled_store, f"dataset.k={n}", "kd.tail=sampled", "train.train_iters=1")
    refusals = []
    for store, tail, k in ((sampled_store, "ghost", n), (topk_store, "sampled", K)):
        wrong = build_config("tiny_gpt_kd_cpu_fp32_config", tiny_overrides(store, f"dataset.k={k}", f"kd.tail={tail}"))
        wrong.model.finalize()
        try:
            check_kd_config(wrong)
            refusals.append("accepted")
        except ValueError as exc:
            refusals.append(str(exc))
    return {"fused": float(loss_sum), "manual": manual_sampled_kl(reference_model, batch), "tokens": int(num_tokens),
            "weights_equal": torch.equal(batch.teacher.weights[0], weights),
            "weights_shape": tuple(batch.teacher.weights.shape), "history": history,
            "refusals": refusals}


def fixed_batch(cfg, rows: int = 2):
    from megatron.bridge.data.base import DatasetBuildContext

    dataset = cfg.dataset.build_datasets(DatasetBuildContext(train_samples=rows, valid_samples=0, test_samples=0))[0]
    return torch.utils.data.default_collate([dataset[i] for i in range(rows)])   # a batch-first KDRow


def forward_step_loss(cfg, model, batch):
    """(loss_sum, num_tokens, report) of one ``kd_forward_step`` on ``batch`` (Bridge's GlobalState holds cfg)."""
    from megatron.bridge.training.state import GlobalState

    from megatron_kd_plugin.bridge.forward_step import kd_forward_step

    state = GlobalState()
    state.cfg = cfg
    with torch.no_grad():
        output, loss_func = kd_forward_step(state, iter([batch]), model)
        return loss_func(output)


def tp1_body(store, hf_student):
    """Rank 0 of a TP=1 world: write the cache, train the reference and the ablations, check the step by hand."""
    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron_kd_plugin.commands.train import build_config

    write_teacher_cache(store)
    cfg = build_config("tiny_gpt_kd_cpu_fp32_config", tiny_overrides(store))
    cfg.model.finalize()
    seed_model_parallel(cfg.rng.seed)
    untrained = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    reference_model, reference = train(store)
    batch = fixed_batch(cfg)
    # the forward step's loss (fused, through output_processor) == float64 recomputation from the model's logits
    loss_sum, num_tokens, report = forward_step_loss(cfg, reference_model, batch)
    expected_sum, expected_tokens = manual_ghost_kl(reference_model, batch)
    check = {"fused": float(loss_sum), "manual": expected_sum, "tokens": (int(num_tokens), expected_tokens),
             "report keys": sorted(report), "untrained": float(forward_step_loss(cfg, untrained, batch)[0])}
    _, alpha_half = train(store, "kd.alpha=0.5", "train.train_iters=1")
    ablations = {
        "student architecture (1 layer, 48 wide, tied embeddings)":
            trained_on_one_batch(store, "model.num_layers=1", "model.hidden_size=48", "model.ffn_hidden_size=96",
                                 "model.share_embeddings_and_output_weights=True"),
        "seq_length 16 (divides 32), micro-batch 1, lr 1e-3":
            trained_on_one_batch(store, "model.seq_length=16", "dataset.seq_length=16", "train.micro_batch_size=1",
                                 "optimizer.lr=1e-3", "optimizer.min_lr=1e-3"),
    }
    return {"history": reference, "params": gathered_parameters(reference_model), "check": check,
            "alpha_half": alpha_half, "ablations": ablations, "real_recipes": validate_real_recipes(hf_student),
            "sampled": sampled_store_step(store.with_name("sampled.zarr"), store, reference_model)}


def trained_on_one_batch(store, *extra: str) -> dict:
    """Train the recipe with ``extra`` overrides: its history, and the KD loss on one fixed batch of the model
    before (the same seed, untrained) and after training (each step reads other rows, so the steps' own losses
    compare batches as much as models)."""
    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron_kd_plugin.commands.train import build_config

    cfg = build_config("tiny_gpt_kd_cpu_fp32_config", tiny_overrides(store, *extra))
    cfg.model.finalize()
    seed_model_parallel(cfg.rng.seed)
    untrained = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    model, history = train(store, *extra)
    batch = fixed_batch(cfg)
    return {"history": history, "before": float(forward_step_loss(cfg, untrained, batch)[0]),
            "after": float(forward_step_loss(cfg, model, batch)[0])}


def validate_real_recipes(hf_student) -> dict[str, int]:
    """Bridge's own ``runtime_config_update`` (mixed precision, DP size, ``cfg.validate()``) accepts the Qwen3
    recipes (with the tiny HF student) at their world sizes; the KD store check is skipped (no 32K cache here)."""
    from unittest import mock

    import megatron.bridge.training.config as bridge_config
    from megatron.bridge.training.config import runtime_config_update

    import megatron_kd_plugin.bridge.config as kd_config
    from megatron_kd_plugin.recipes import RECIPES

    data_parallel = {}
    for name, world_size in (("qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config", 1),
                             ("qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config", 8)):
        with mock.patch.object(bridge_config, "get_world_size_safe", lambda: world_size), \
                mock.patch.object(kd_config, "check_kd_config", lambda cfg: None):
            cfg = RECIPES[name](hf_path=str(hf_student))
            runtime_config_update(cfg)
        data_parallel[name] = cfg.data_parallel_size
    return data_parallel


def tp2_body(store):
    model, history = train(store, "model.tensor_model_parallel_size=2")
    return {"history": history, "params": gathered_parameters(model)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Where ``runs`` writes the teacher cache."""
    return tmp_path_factory.mktemp("bridge") / "teacher.zarr"


@pytest.fixture(scope="module")
def runs(store, tiny_hf_qwen3):
    from tests.distributed import run_on_ranks

    tp1 = run_on_ranks(1, tp1_body, store, tiny_hf_qwen3, timeout=600)[0]
    tp2 = run_on_ranks(2, tp2_body, store, timeout=600)
    return tp1, tp2


def test_forward_step_loss_equals_float64_recomputation_from_model_logits(runs):
    check = runs[0]["check"]
    assert check["tokens"][0] == check["tokens"][1] == 2 * SEQ
    assert math.isclose(check["fused"], check["manual"], rel_tol=1e-5), check
    assert check["report keys"] == ["kd loss", "student top-K mass", "teacher top-K mass"]


def test_kd_loss_decreases_over_training(runs):
    check, history = runs[0]["check"], runs[0]["history"]
    assert check["fused"] < 0.9 * check["untrained"], check   # the same batch, before and after training
    kd = [row["kd loss"] for row in history]
    assert len(kd) == STEPS and kd[-1] < kd[0], kd
    assert all(0 < row["teacher top-K mass"] <= 1 + 1e-6 for row in history)


def test_tp2_matches_tp1_step_for_step(runs):
    tp1, tp2 = runs
    for rank_result in tp2:   # both TP ranks report the same (all-reduced) losses
        for a, b in zip(tp1["history"], rank_result["history"]):
            for key in ("loss", "kd loss", "grad norm"):
                assert math.isclose(a[key], b[key], rel_tol=2e-5), (key, a, b)
    # Adam turns fp32 reduction-order noise in near-zero gradients into updates of up to lr (3e-3) per step, so
    # parameters agree to ~1e-5; a TP error (e.g. rank-partial dX) moves them by O(lr) per step
    assert tp1["params"].keys() == tp2[0]["params"].keys()
    for name, value in tp1["params"].items():
        for rank_result in tp2:
            torch.testing.assert_close(rank_result["params"][name], value, rtol=0, atol=3e-5, msg=name)


def test_alpha_below_one_reports_lm_loss(runs):
    row = runs[0]["alpha_half"][0]
    assert {"kd loss", "lm loss"} <= row.keys()
    assert math.isclose(row["loss"], 0.5 * row["kd loss"] + 0.5 * row["lm loss"], rel_tol=1e-5), row


def test_bridge_accepts_the_real_model_recipes(runs):
    assert runs[0]["real_recipes"] == {"qwen3_8b_to_0p6b_kd_32k_1gpu_h200_bf16_config": 1,
                                       "qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config": 2}


def test_one_store_serves_other_architectures_and_seq_lengths(runs):
    for name, run in runs[0]["ablations"].items():
        kd = [row["kd loss"] for row in run["history"]]
        assert len(kd) == STEPS and all(map(math.isfinite, kd)), name
        assert run["after"] < run["before"], (name, run)   # the same batch, before and after training


def test_one_training_step_on_a_sampled_store_and_its_loss_equals_the_float64_sampled_kl(runs):
    sampled = runs[0]["sampled"]
    assert sampled["weights_equal"] and sampled["weights_shape"] == (2, SEQ, 12)
    assert sampled["tokens"] == 2 * SEQ
    assert math.isclose(sampled["fused"], sampled["manual"], rel_tol=1e-5), sampled
    assert len(sampled["history"]) == 1 and all(math.isfinite(v) for v in sampled["history"][0].values())
    assert "kd.tail='ghost' does not fit the sampled store" in sampled["refusals"][0]
    assert "kd.tail='sampled' does not fit the top-K store" in sampled["refusals"][1]


def test_train_command_logs_each_interval_and_a_killed_run_keeps_its_history_and_events(runs, store, tmp_path):
    """``python -m megatron_kd_plugin train`` with logger.log_interval=2 and a tensorboard_dir, SIGKILLed once it
    printed iteration 4: a line at every 2nd step with Bridge's fields, and on disk every step it finished, in the
    history file and in TensorBoard events (Bridge's writer), equal to what it printed."""
    import json
    import os
    import pathlib
    import signal
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_kd_plugin.bridge.cpu_log import read_history

    repo = pathlib.Path(__file__).resolve().parents[1]
    tb = tmp_path / "tb"
    (tb).mkdir()
    (tb / "history.jsonl").write_text(json.dumps({"step": 0, "loss": -1.0}) + "\n")   # an old run's: replaced
    command = [sys.executable, "-m", "megatron_kd_plugin", "train", "--recipe", "tiny_gpt_kd_cpu_fp32_config",
               *tiny_overrides(store, "train.train_iters=100000", "kd.alpha=0.5", "logger.log_interval=2",
                               f"logger.tensorboard_dir={tb}")]
    env = dict(os.environ, PYTHONPATH=str(repo), MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("iteration      4/"):
                break
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=scaled(60))
    logged = [line for line in lines if line.startswith("iteration")]
    assert [line.split("|")[0].split()[1] for line in logged] == ["2/100000", "4/100000"], "".join(lines[-30:])
    fields = dict(part.strip().split(": ") for part in logged[1].split("|")[1:])
    assert set(fields) == {"consumed samples", "tokens/s", "learning rate", "loss", "kd loss", "lm loss", "grad norm"}
    assert fields["consumed samples"] == "16" and float(fields["tokens/s"].replace(",", "")) > 0

    history = read_history(tb)
    assert len(history) >= 4 and [row["step"] for row in history] == list(range(len(history)))
    for key in ("loss", "kd loss", "lm loss", "grad norm"):   # the line rounds (6 digits; grad norm 4)
        assert float(fields[key]) == pytest.approx(history[3][key], rel=1e-3), key
    events = EventAccumulator(str(tb))
    events.Reload()
    kd = {event.step: event.value for event in events.Scalars("kd loss")}
    assert {1, 2, 3, 4} <= kd.keys() and {"learning-rate", "grad-norm", "lm loss"} <= set(events.Tags()["scalars"])
    for row in history[:4]:
        assert kd[row["step"] + 1] == pytest.approx(row["kd loss"], rel=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
