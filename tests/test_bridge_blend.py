"""Issue #30 through the dataset provider and the CPU loop: blends of stores in megatron-core's blending order
(resumable, any DP size), per-split blends, an ensemble of teachers over the same samples, the refusals, the
per-source figures of training and validation, and a resume refused when the blend changed and bit-identical when
it did not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.bridge.data.base import DatasetBuildContext
from megatron.bridge.data.samplers import build_pretraining_data_loader

from megatron_kd_plugin.bridge.config import check_kd_config
from megatron_kd_plugin.cache.rows.ensemble_rows import mixture_teacher
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
from megatron_kd_plugin.cache.writer import write_cache
from megatron_kd_plugin.commands.train import build_config
from tests.test_bridge_data import VOCAB, SEQ, bigram_teacher

SAMPLES = 8


def _source(seed: int, samples: int = SAMPLES, fingerprint: str = "blend", tokenizer: str = "synthetic"):
    stream = np.random.default_rng(seed).integers(0, VOCAB, size=samples * SEQ + 1)
    return TokenWindows(stream, SEQ, num_samples=samples, fingerprint=f"{fingerprint}-{seed}", tokenizer=tokenizer,
                        tokenizer_vocab_size=VOCAB)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """code (K=4), prose (top-p, K=6: padding slots), prose2 (prose's samples, another teacher: an ensemble's
    second member), a sampled store, a store of another tokenizer, and three shards of one token stream cached by
    separate jobs (disjoint samples)."""
    root = tmp_path_factory.mktemp("blend")
    paths = {name: root / f"{name}.zarr" for name in ("code", "prose", "prose2", "sampled", "other_tok")}
    common = dict(vocab_size=VOCAB, samples_per_shard=4, progress=False)
    write_cache(_source(1), bigram_teacher(1), paths["code"], k=4, teacher="code-teacher", **common)
    write_cache(_source(2), bigram_teacher(2), paths["prose"], k=6, teacher="general", top_p=0.6, min_k=2, **common)
    write_cache(_source(2), bigram_teacher(3), paths["prose2"], k=5, teacher="prose-expert", **common)
    write_cache(_source(1), bigram_teacher(1), paths["sampled"], k=4, teacher="code-teacher", mode="sampled",
                **common)
    write_cache(_source(1, tokenizer="other"), bigram_teacher(1), paths["other_tok"], k=4, teacher="x", **common)
    stream = np.random.default_rng(9).integers(0, VOCAB, size=3 * 4 * SEQ + 1)
    for job in range(3):   # job j caches samples 4j..4j+3 of one stream, into its own store
        part = TokenWindows(stream[job * 4 * SEQ:(job + 1) * 4 * SEQ + 1], SEQ, num_samples=4, fingerprint=f"j{job}",
                            tokenizer="synthetic", tokenizer_vocab_size=VOCAB)
        paths[f"job{job}"] = root / f"job{job}.zarr"
        write_cache(part, bigram_teacher(1), paths[f"job{job}"], k=4, teacher="code-teacher", **common)
    return paths


def config(*overrides: str):
    return build_config("tiny_gpt_kd_cpu_fp32_config", [f"model.vocab_size={VOCAB}", f"model.seq_length={SEQ}",
                                                        f"dataset.seq_length={SEQ}", *overrides])


def datasets(cfg, train=40, valid=0, test=0):
    return cfg.dataset.build_datasets(DatasetBuildContext(train_samples=train, valid_samples=valid, test_samples=test))


def test_blend_rows_follow_megatrons_blending_order_and_each_row_is_its_stores(stores):
    """"0.75 code 0.25 prose": every prefix holds the stores 3:1 (megatron-core's greedy index), each row is the row
    its store's own dataset gives (padded to the larger K with slots of no support) and carries its source index;
    the order is a pure function of the seed."""
    cfg = config(f"dataset.blend='0.75 {stores['code']} 0.25 {stores['prose']}'")
    train = datasets(cfg, train=64)[0]
    assert cfg.dataset.source_names == ("code", "prose")
    sources = [train.source_of(i)[0] for i in range(64)]
    for prefix in (4, 16, 64):
        assert sources[:prefix].count(1) == prefix // 4, sources[:prefix]
    alone = [datasets(config(f"dataset.cache_path={stores[name]}"), train=64)[0] for name in ("code", "prose")]
    for i in (0, 1, 2, 3, 5, 33, 63):
        part, part_row = train.source_of(i)
        row, own = train[i], alone[part][part_row]
        assert int(row.source) == part and torch.equal(row.tokens, own.tokens)
        assert row.teacher.ids.shape == (SEQ, 6)
        k = own.teacher.ids.shape[-1]
        assert torch.equal(row.teacher.ids[:, :k], own.teacher.ids) and torch.equal(row.teacher.logprobs[:, :k],
                                                                                    own.teacher.logprobs)
        assert (row.teacher.logprobs[:, k:] == -torch.inf).all()
    again = datasets(config(f"dataset.blend='0.75 {stores['code']} 0.25 {stores['prose']}'"), train=64)[0]
    other = datasets(config(f"dataset.blend='0.75 {stores['code']} 0.25 {stores['prose']}'", "dataset.seed=5"),
                     train=64)[0]
    tokens = lambda ds: torch.stack([ds[i].tokens for i in range(16)])   # noqa: E731
    assert torch.equal(tokens(train), tokens(again)) and not torch.equal(tokens(train), tokens(other))


def test_blend_resumed_by_consumed_samples_continues_on_the_same_rows_at_any_dp_size(stores):
    """Bridge's sampler at DP 2 resumed at consumed_samples reads the rows the uninterrupted run reads next, and the
    two ranks together read the global sequence one rank reads."""
    blend = f"dataset.blend='0.5 {stores['code']} 0.5 {stores['prose']}'"
    train = datasets(config(blend), train=16)[0]

    def rows(consumed: int, rank: int) -> list[torch.Tensor]:
        loader = build_pretraining_data_loader(train, consumed, "single", 1, 0, True, pin_memory=False,
                                               data_parallel_rank=rank, data_parallel_size=2)
        return [torch.cat([batch.tokens[0], batch.source]) for batch in loader]

    full = [rows(0, rank) for rank in range(2)]
    for rank in range(2):
        resumed = rows(6 * 2, rank)
        assert len(resumed) == len(full[rank]) - 6
        assert all(torch.equal(a, b) for a, b in zip(full[rank][6:], resumed))
    fresh = datasets(config(blend), train=16)[0]      # as a restarted job builds it
    interleaved = [row for pair in zip(*full) for row in pair]
    assert all(torch.equal(row, torch.cat([fresh[i].tokens, fresh[i].source[None]]))
               for i, row in enumerate(interleaved))


def test_stores_of_separate_cache_jobs_blend_as_one_epoch_of_each(stores):
    """Three stores cached by separate jobs over disjoint parts of one stream, blended without weights (Megatron's
    blend of sizes): one epoch of the blend visits every sample of every store once."""
    cfg = config(f"dataset.blend='{stores['job0']} {stores['job1']} {stores['job2']}'")
    train = datasets(cfg, train=12)[0]
    seen = sorted((int(train[i].source), train.parts[int(train[i].source)].window_of(train.source_of(i)[1])[0])
                  for i in range(12))
    assert seen == [(job, sample) for job in range(3) for sample in range(4)]


def test_per_split_blends_read_whole_stores(stores):
    cfg = config(f"dataset.blend_per_split=['0.5 {stores['code']} 0.5 {stores['prose']}', '{stores['prose2']}', null]")
    train, valid, test = datasets(cfg, train=16, valid=8, test=8)
    assert cfg.dataset.source_names == ("code", "prose", "prose2") and test is None
    assert {int(valid[i].source) for i in range(8)} == {2}
    assert sorted(valid.window_of(i)[0] for i in range(8)) == list(range(SAMPLES))   # the whole store


def test_ensemble_rows_are_the_mixture_of_the_teachers_rows(stores):
    """"0.25 prose 0.75 prose2": each row's teacher is ``mixture_teacher`` of the two stores' rows of the same
    sample (K 6 + 5 slots); a store of other tokens is refused on read, naming the sample."""
    cfg = config(f"dataset.ensemble='0.25 {stores['prose']} 0.75 {stores['prose2']}'")
    check_kd_config(cfg)
    train = datasets(cfg, train=8)[0]
    members = [datasets(config(f"dataset.cache_path={stores[n]}", "dataset.shuffle=false"), train=8)[0]
               for n in ("prose", "prose2")]
    for i in (0, 5):
        sample, window = train.window_of(i)
        row = train[i]
        expected = mixture_teacher([m.kind.row(sample, window).teacher for m in members], (0.25, 0.75))
        assert row.teacher.ids.shape == (SEQ, 11)
        assert torch.equal(row.teacher.ids, expected.ids) and torch.equal(row.teacher.logprobs, expected.logprobs)
    mass = torch.stack([train[i].teacher.mass() for i in range(4)])
    assert (mass <= 1 + 1e-6).all()
    bad = datasets(config(f"dataset.ensemble='{stores['prose']} {stores['code']}'"), train=4)[0]
    with pytest.raises(ValueError, match=r"sample \d+: .*code.zarr holds other tokens than .*prose.zarr"):
        bad[0]


def test_what_cannot_blend_is_refused_in_one_line_before_step_one(stores):
    check_kd_config(config(f"dataset.blend='0.5 {stores['code']} 0.5 {stores['prose']}'"))
    refusals = {
        r"kinds of teacher rows cannot blend \(TopKTeacher: .*code.*; SampledTeacher: .*sampled.*\): their tails "
        "differ": f"dataset.blend='{stores['code']} {stores['sampled']}'",
        "cached with different tokenizers": f"dataset.blend='{stores['code']} {stores['other_tok']}'",
        "expected 'WEIGHT PATH WEIGHT PATH": "dataset.blend='0.5 a.zarr 0.5'",
        "weights must be >= 0": f"dataset.blend='-1 {stores['code']} 2 {stores['prose']}'",
        "dataset.blend and dataset.ensemble are both set":
            (f"dataset.blend='{stores['code']}'", f"dataset.ensemble='{stores['code']} {stores['prose']}'"),
        "dataset.split='90,10,0' with dataset.blend_per_split": (f"dataset.blend_per_split=['{stores['code']}', null, "
                                                                  "null]", "dataset.split='90,10,0'"),
        "an ensemble mixes top-K": f"dataset.ensemble='{stores['code']} {stores['sampled']}'",
        "vocab": (f"dataset.blend='{stores['code']} {stores['prose']}'", f"model.vocab_size={VOCAB // 2}"),
    }
    for message, overrides in refusals.items():
        overrides = (overrides,) if isinstance(overrides, str) else overrides
        with pytest.raises(ValueError, match=message) as error:
            check_kd_config(config(*overrides))
        assert "\n" not in str(error.value), message


def train_body(stores, tmp):
    """One rank: the tiny recipe on a 50/50 blend, straight and stopped at step 2 then resumed (and a resume with a
    changed blend, refused); the forward step's validation figures per source."""
    import types

    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.bridge.forward_step import kd_forward_step
    from tests.test_bridge_train import gathered_parameters

    blend = f"dataset.blend='0.5 {stores['code']} 0.5 {stores['prose']}'"
    ckpt = [f"checkpoint.save={tmp / 'ckpt'}", f"checkpoint.load={tmp / 'ckpt'}"]

    def run(*extra):
        cfg = config("kd.alpha=0.5", *extra)
        models, history = train_on_cpu(cfg, progress=False)
        return cfg, models[0], history

    cfg, straight_model, straight = run(blend)
    _, _, first = run(blend, *ckpt, "train.exit_interval=2")
    try:
        run(f"dataset.blend='0.25 {stores['code']} 0.75 {stores['prose']}'", *ckpt)
        refused = "resumed"
    except ValueError as error:
        refused = str(error)
    _, resumed_model, second = run(blend, *ckpt)
    # validation as Bridge's evaluation runs it: the forward step without gradients on the valid split's batches
    valid = datasets(config(f"dataset.blend_per_split=['{stores['code']}', '0.5 {stores['code']} 0.5 "
                            f"{stores['prose']}', null]"), train=4, valid=4)[1]
    batch = torch.utils.data.default_collate([valid[i] for i in range(4)])
    state = types.SimpleNamespace(cfg=cfg)
    reports = {}
    with torch.no_grad():
        for name, rows in (("mixed", slice(None)), ("code", batch.source == 0), ("prose", batch.source == 1)):
            part = type(batch)(*(None if t is None else torch.utils._pytree.tree_map(lambda x: x[rows], t)
                                 for t in batch))
            output, loss_func = kd_forward_step(state, iter([part]), straight_model)
            reports[name] = {key: value.clone() for key, value in loss_func(output)[2].items()}
    return {"straight": straight, "resumed": first + second, "refused": refused, "reports": reports,
            "sources": batch.source.tolist(), "params": gathered_parameters(straight_model),
            "resumed params": gathered_parameters(resumed_model)}


@pytest.fixture(scope="module")
def trained(stores, tmp_path_factory):
    from tests.distributed import run_on_ranks

    return run_on_ranks(1, train_body, stores, tmp_path_factory.mktemp("blend_train"))[0]


def test_training_logs_each_sources_figures(trained):
    """A 50/50 blend, 2 rows of each store a step: every step's history holds ``kd loss [code]`` and ``kd loss
    [prose]`` (and ``lm loss [...]``), whose mean is the step's ``kd loss`` (equal token counts)."""
    for row in trained["straight"]:
        assert {"kd loss [code]", "kd loss [prose]", "lm loss [code]", "lm loss [prose]"} <= row.keys(), row
        assert row["kd loss"] == pytest.approx((row["kd loss [code]"] + row["kd loss [prose]"]) / 2, rel=1e-6)
        assert row["kd loss [code]"] != row["kd loss [prose]"]


def test_validation_reports_each_source_as_the_loss_of_its_rows_alone(trained):
    reports, sources = trained["reports"], trained["sources"]
    assert sorted(sources) == [0, 0, 1, 1]
    for name in ("code", "prose"):
        for figure in ("kd loss", "lm loss"):
            torch.testing.assert_close(reports["mixed"][f"{figure} [{name}]"], reports[name][figure], rtol=1e-6,
                                       atol=0)


def test_resume_on_the_same_blend_is_bit_identical_and_a_changed_blend_is_refused(trained):
    assert trained["resumed"] == trained["straight"]                       # every figure of every step, exactly
    for name, value in trained["params"].items():
        assert torch.equal(trained["resumed params"][name], value), name
    refused = trained["refused"]
    assert "holds a run trained on other data: the train blend was '0.5 " in refused, refused
    assert "now '0.25 " in refused and "\n" not in refused, refused
