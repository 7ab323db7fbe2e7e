"""The heal sweep tool's bookkeeping: how a heal's words become the demo's train command, which store a heal reads,
and the won-back shares of its table."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from megatron_kd_plugin.demo.pipeline import PRESETS, cache_command, heal_arguments, load_config, won_back
from tools.bench_heal import Heal, check_store_tail, heal_config, table, warnings_before_step_one

STORES = {"sample64": ["--draws", "64"], "top100": ["--topk", "100"], "topp0.9": ["--top-p", "0.9"]}


def test_a_heal_splits_its_own_keys_from_the_train_overrides_kept_in_order():
    heal = Heal.parse("kd.alpha=1.0 lr=1e-3  steps=300 store=sample64 kd.tail=sampled samples=800", STORES)
    assert (heal.lr, heal.steps, heal.samples, heal.store) == (1e-3, 300, 800, "sample64")
    assert heal.overrides == ("kd.alpha=1.0", "kd.tail=sampled")
    assert heal.name == "kd.alpha=1.0 lr=1e-3 steps=300 store=sample64 kd.tail=sampled samples=800"
    assert heal.folder == "kd.alpha_1.0__lr_1e-3__steps_300__store_sample64__kd.tail_sampled__samples_800"
    plain = Heal.parse("kd.alpha=0", STORES)
    assert (plain.lr, plain.steps, plain.samples, plain.store, plain.overrides) == (None, None, None, "demo",
                                                                                    ("kd.alpha=0",))
    for bad, match in (("kd.alpha", "KEY=VALUE"), ("", "KEY=VALUE"), ("store=sample8", "neither demo nor")):
        with pytest.raises(ValueError, match=match):
            Heal.parse(bad, STORES)


def test_the_heal_command_is_the_demos_with_the_overrides_last(tmp_path):
    """Bridge's overrides: the last one of a key wins, so a heal's words override the demo's own settings."""
    demo = PRESETS["default"]
    heal = Heal.parse("kd.alpha=1.0 lr=2e-3 steps=300", STORES)
    cfg = heal_config(demo, heal)
    assert (cfg.heal_steps, cfg.heal_lr, cfg.cache_samples) == (300, 2e-3, 300 * demo.micro_batch_size)
    arguments = [*heal_arguments(cfg, tmp_path / "s", tmp_path / "c", tmp_path / "r", alpha=demo.kd_alpha,
                                 lr=cfg.heal_lr), *heal.overrides]
    for expected in ("train.train_iters=300", "optimizer.lr=0.002", "optimizer.min_lr=0.0002",
                     "scheduler.lr_warmup_iters=30"):
        assert expected in arguments, expected
    assert arguments[-1] == "kd.alpha=1.0" and arguments.index(f"kd.alpha={demo.kd_alpha}") < len(arguments) - 1
    assert heal_config(demo, Heal.parse("kd.alpha=0", STORES)) == demo


def test_a_store_keeps_the_cap_of_a_top_p_selection_and_drops_it_for_draws(tmp_path):
    cfg, corpus = PRESETS["default"], type("Corpus", (), {"train_prefix": tmp_path / "train"})
    command = cache_command(cfg, corpus, tmp_path / "t", tmp_path / "s.zarr")     # the demo's own: its draws
    assert command[command.index("--draws") + 1] == str(cfg.draws) and "--topk" not in command
    assert command[command.index("--draw-seed") + 1] == str(cfg.seed)
    top_k_cfg = dataclasses.replace(cfg, draws=0, kd_tail="renorm")
    top_k = cache_command(top_k_cfg, corpus, tmp_path / "t", tmp_path / "s.zarr")
    assert top_k[top_k.index("--topk") + 1] == str(cfg.topk) and "--draws" not in top_k
    assert cache_command(cfg, corpus, tmp_path / "t", tmp_path / "s.zarr", STORES["top100"]) == [
        *command[:command.index("--draws")], "--topk", "100", *command[command.index("--draw-seed") + 2:]]
    sampled = cache_command(cfg, corpus, tmp_path / "t", tmp_path / "s.zarr", STORES["sample64"])
    assert "--topk" not in sampled and sampled[sampled.index("--draws") + 1] == "64"
    top_p = cache_command(cfg, corpus, tmp_path / "t", tmp_path / "s.zarr", STORES["topp0.9"])
    assert top_p[top_p.index("--topk") + 1] == str(cfg.topk) and top_p[top_p.index("--top-p") + 1] == "0.9"
    assert command[command.index("--num-samples") + 1] == str(cfg.cache_samples)


def test_the_demo_pairs_its_store_kind_with_its_tail_and_reads_a_folder_from_before_draws(tmp_path):
    cfg = PRESETS["default"]
    assert (cfg.cache_selection[:2], cfg.teacher_rows, cfg.kd_tail) == (["--draws", "64"], "64 draws", "sampled")
    for draws, tail in ((64, "renorm"), (0, "sampled"), (0, "none"), (-1, "sampled")):
        with pytest.raises(ValueError, match=f"draws={draws} with kd_tail='{tail}'"):
            dataclasses.replace(cfg, draws=draws, kd_tail=tail)
    older = {key: value for key, value in dataclasses.asdict(cfg).items() if key not in ("draws", "kd_tail")}
    (tmp_path / "config.json").write_text(json.dumps(older))
    loaded = load_config(tmp_path)
    assert (loaded.draws, loaded.kd_tail, loaded.cache_selection) == (0, "ghost", ["--topk", "100"])
    (tmp_path / "config.json").write_text(json.dumps(dict(older, kd_tail="renorm")))
    assert (load_config(tmp_path).kd_tail, load_config(tmp_path).teacher_rows) == ("renorm", "top-100")


def test_a_heal_whose_tail_does_not_fit_its_store_is_refused_before_it_runs():
    drawn_demo, top_k_demo = PRESETS["default"], dataclasses.replace(PRESETS["default"], draws=0, kd_tail="renorm")
    fits = [(drawn_demo, "kd.alpha=0 lr=2e-3"), (drawn_demo, "store=top100 kd.tail=renorm"),
            (drawn_demo, "store=topp0.9 kd.tail=ghost"), (top_k_demo, "steps=200"),
            (top_k_demo, "store=sample64 kd.tail=sampled"),
            (drawn_demo, "kd.tail=renorm store=sample64 kd.tail=sampled")]
    for demo, words in fits:
        check_store_tail(demo, Heal.parse(words, STORES), STORES)
    refused = [(drawn_demo, "store=top100", "store=top100 holds a top-K and the heal's tail is 'sampled'"),
               (drawn_demo, "kd.tail=renorm", "store=demo holds draws and the heal's tail is 'renorm'"),
               (top_k_demo, "store=sample64", "store=sample64 holds draws and the heal's tail is 'renorm'")]
    for demo, words, match in refused:
        with pytest.raises(ValueError, match=match):
            check_store_tail(demo, Heal.parse(words, STORES), STORES)


def test_won_back_is_the_share_of_the_pruning_cost_and_the_table_shows_it():
    metrics = {"teacher": {"perplexity": 100.0, "kl_to_teacher": 0.0},
               "pruned": {"perplexity": 140.0, "kl_to_teacher": 0.2},
               "healed": {"perplexity": 110.0, "kl_to_teacher": 0.05},
               "worse": {"perplexity": 150.0, "kl_to_teacher": 0.3}}
    assert won_back(metrics, "healed") == pytest.approx((0.75, 0.75))
    assert won_back(metrics, "worse") == pytest.approx((-0.25, -0.5))
    rows = [dict(heal=name, bytes_per_token=120.0, seconds=40.0, warnings=[], **metrics[name])
            for name in ("healed", "worse")]
    rows.append(dict(heal="kd.temperature=2", bytes_per_token=120.0, seconds=3.0, failed="exit 2: train: error: x",
                     warnings=["kd.temperature=2.0 ..."]))
    lines = table(metrics, rows).splitlines()
    assert "| `healed` | 120.0 | 110.000 | 0.0500 | 75% | 75% | 40 |" in lines
    assert "| `worse` | 120.0 | 150.000 | 0.3000 | -25% | -50% | 40 |" in lines
    assert any(line.startswith("| `kd.temperature=2` (warned) |") and "exit 2: train: error: x" in line
               for line in lines)
    assert lines[-1] == "warned before step one: kd.temperature=2.0 ..."


def test_only_the_loss_options_warnings_before_step_one_are_collected(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n".join([
        "/x/options.py:9: UserWarning: kd.tail='none' with kd.alpha=1.0 ...",
        "/y/other.py:3: UserWarning: something else",
        " [2025] iteration        1/     100 | lm loss: 5.0",
        "/x/options.py:9: UserWarning: kd.later ...",
    ]) + "\n")
    assert warnings_before_step_one(log) == ["kd.tail='none' with kd.alpha=1.0 ..."]


def test_a_demo_folder_gives_back_its_config(tmp_path):
    cfg = dataclasses.replace(PRESETS["mini"], seed=7, heal_steps=3)
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert load_config(pathlib.Path(tmp_path)) == cfg
