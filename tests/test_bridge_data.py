"""The dataset provider over a store written by the cache tool: rows, windows, splits, seeded order, resume with
Bridge's samplers, and the checks that stop a bad run before step one (single process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.bridge.data.base import DatasetBuildContext
from megatron.bridge.data.samplers import build_pretraining_data_loader

from megatron_kd_plugin.bridge.config import check_kd_config
from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
from megatron_kd_plugin.cache.writer import write_cache
from megatron_kd_plugin.commands.train import build_config

VOCAB, SEQ, SAMPLES, K = 64, 16, 12, 4


def bigram_teacher(seed: int = 0):
    """A tiny teacher: next-token logits from a fixed random table of the current token, [b, s] -> [s, b, V]."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return lambda tokens, position_ids=None: table[tokens].transpose(0, 1)


def source(num_samples: int = SAMPLES) -> TokenWindows:
    stream = np.random.default_rng(1).integers(0, VOCAB, size=num_samples * SEQ + 1)
    return TokenWindows(stream, SEQ, num_samples=num_samples, fingerprint="test-bridge-data", tokenizer="synthetic",
                        tokenizer_vocab_size=VOCAB)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("bridge_data") / "cache.zarr"
    write_cache(source(), bigram_teacher(), path, k=K, vocab_size=VOCAB, teacher="bigram", samples_per_shard=4,
                progress=False)
    return path


def kd_config(store, *overrides: str):
    return build_config("tiny_gpt_kd_cpu_fp32_config",
                        [f"dataset.cache_path={store}", f"model.vocab_size={VOCAB}", f"model.seq_length={SEQ}",
                         f"dataset.seq_length={SEQ}", *overrides])


def datasets(cfg, train=40, valid=0, test=0):
    return cfg.dataset.build_datasets(DatasetBuildContext(train_samples=train, valid_samples=valid, test_samples=test))


def test_rows_are_windows_of_the_cache_with_shifted_labels(store):
    reader = TopKCacheReader(store)
    cfg = kd_config(store, "model.seq_length=8", "dataset.seq_length=8")   # 8 divides 16: two rows per sample
    train, _, _ = datasets(cfg)
    assert len(train) == 40
    seen = set()
    for row in range(train.windows_per_epoch):
        sample, window = train.window_of(row)
        seen.add((sample, window))
        item, cached = train[row], reader[sample]
        begin = window * 8
        assert torch.equal(item.tokens, cached.tokens[begin:begin + 8].long())
        assert torch.equal(item.labels, cached.tokens[begin + 1:begin + 9].long())
        assert torch.equal(item.teacher.ids.long(), cached.teacher.ids[begin:begin + 8].long())
        torch.testing.assert_close(item.teacher.logprobs, cached.teacher.logprobs[begin:begin + 8].float())
        assert torch.equal(item.position_ids, torch.arange(8)) and bool((item.loss_mask == 1).all())
        assert item.teacher.ids.shape == item.teacher.logprobs.shape == (8, K)
    assert seen == {(s, w) for s in range(SAMPLES) for w in range(2)}   # one epoch covers every window once


def test_order_is_seeded_and_each_epoch_reshuffled(store):
    first = [datasets(kd_config(store))[0].window_of(i) for i in range(24)]
    again = [datasets(kd_config(store))[0].window_of(i) for i in range(24)]
    other = [datasets(kd_config(store, "dataset.seed=99"))[0].window_of(i) for i in range(24)]
    assert first == again and first != other
    assert first[:12] != first[12:] and sorted(first[:12]) == sorted(first[12:])


def test_splits_are_disjoint_ranges_of_cached_samples(store):
    train, valid, test = datasets(kd_config(store, "dataset.split='50,25,25'"), train=12, valid=6, test=6)
    samples = [{ds.window_of(i)[0] for i in range(len(ds))} for ds in (train, valid, test)]
    assert samples == [set(range(0, 6)), set(range(6, 9)), set(range(9, 12))]
    assert datasets(kd_config(store), valid=4)[1] is None   # default split: no evaluation rows


@pytest.mark.parametrize("dp_size,micro_batch", [(1, 2), (2, 1)])
def test_resume_by_consumed_samples_continues_on_the_same_rows(store, dp_size, micro_batch):
    """Bridge's sampler resumed at consumed_samples reads exactly the rows the uninterrupted run reads next."""
    def rows(consumed: int, rank: int) -> list[torch.Tensor]:
        train = datasets(kd_config(store), train=48)[0]   # a fresh dataset, as a restarted job builds it
        loader = build_pretraining_data_loader(train, consumed, "single", micro_batch, 0, True, pin_memory=False,
                                               data_parallel_rank=rank, data_parallel_size=dp_size)
        return [batch.tokens for batch in loader]

    for rank in range(dp_size):
        full = rows(0, rank)
        step_rows = micro_batch * dp_size
        resumed = rows(10 * step_rows, rank)
        assert len(resumed) == len(full) - 10
        for a, b in zip(full[10:], resumed):
            assert torch.equal(a, b)


def test_bad_stores_and_mismatched_sizes_are_refused_before_step_one(store, tmp_path):
    check_kd_config(kd_config(store))                                  # the good case passes
    with pytest.raises(ValueError, match="vocab"):
        check_kd_config(kd_config(store, f"model.vocab_size={VOCAB // 2}"))
    with pytest.raises(ValueError, match=f"k={K + 1} requested"):
        check_kd_config(kd_config(store, f"dataset.k={K + 1}"))
    with pytest.raises(ValueError, match="divide"):
        check_kd_config(kd_config(store, "model.seq_length=12", "dataset.seq_length=12"))
    with pytest.raises(ValueError, match="model.seq_length=8"):
        check_kd_config(kd_config(store, "model.seq_length=8"))
    with pytest.raises(ValueError, match="bogus"):
        check_kd_config(kd_config(store, "kd.divergence=bogus"))
    with pytest.raises(ValueError, match="model.mtp_num_layers=1: the KD step does not train multi-token"):
        check_kd_config(kd_config(store, "model.mtp_num_layers=1"))
    unfinished = tmp_path / "unfinished.zarr"
    calls = []

    def dies_in_second_shard(tokens, position_ids=None):
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt("killed")
        return bigram_teacher()(tokens)

    with pytest.raises(KeyboardInterrupt):
        write_cache(source(), dies_in_second_shard, unfinished, k=K, vocab_size=VOCAB, teacher="bigram",
                    samples_per_shard=4, progress=False)
    with pytest.raises(ValueError, match="unfinished|not finished|incomplete"):
        check_kd_config(kd_config(unfinished))


def test_kd_forward_step_refuses_mtp_students():
    """A student with MTP heads is refused before any batch is read or logits are built (GPTModel's MTP path
    would build [s, b, V] logits from the labels the step passes)."""
    import types

    from megatron_kd_plugin.bridge.forward_step import kd_forward_step
    from megatron_kd_plugin.loss import KDLossOptions

    model = torch.nn.Module()
    model.config = types.SimpleNamespace(mtp_num_layers=2, sequence_parallel=False)
    state = types.SimpleNamespace(cfg=types.SimpleNamespace(kd=KDLossOptions()))
    with pytest.raises(ValueError, match="model.mtp_num_layers=2"):
        kd_forward_step(state, iter(()), model)


def test_loss_options_that_left_a_student_worse_are_refused_or_warned_before_step_one(store, capsys):
    """The option screen's harmful combinations (docs/store-kinds-and-loss.md): tail='none' without the hard labels or at tau != 1 is
    refused in one line naming the alternative (by the train command too, before any training), a heal at
    0 < alpha < 1 warned, and renorm at alpha 1 for a student from random weights; the recommended settings, a
    from-scratch student on the ghost tail and the CE-only control are not."""
    import warnings

    from megatron_kd_plugin.commands import train

    heal = "checkpoint.pretrained_checkpoint=/a/trained/student"      # only read: whether the student is trained
    for options in (["kd.tail=none"], ["kd.tail=none", "kd.temperature=2.0", "kd.alpha=0.5"]):
        with pytest.raises(ValueError, match=r"kd.tail='none' with .* use kd.tail='renorm' or 'ghost'$"):
            check_kd_config(kd_config(store, *options))
    assert train.main(["--recipe", "tiny_gpt_kd_cpu_fp32_config", "--seq-length", str(SEQ),
                       f"dataset.cache_path={store}", f"model.vocab_size={VOCAB}", "kd.tail=none"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train: error: kd.tail='none' with kd.alpha=1.0"), lines
    for options in (["kd.alpha=0.5"], ["kd.alpha=0.9", "kd.tail=none"], ["kd.alpha=0.5", "kd.divergence=jsd"]):
        with pytest.warns(UserWarning, match=r"^kd.alpha=0.\d mixes hard-label cross entropy into a heal"):
            check_kd_config(kd_config(store, heal, *options))
    with pytest.warns(UserWarning, match=r"^kd.tail='renorm' at kd.alpha=1.0 teaches a student that does not start"):
        check_kd_config(kd_config(store, "kd.tail=renorm"))             # from random weights: renorm taught nothing
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"kd\.")                # a warning of ours would raise here
        for options in ([heal], [heal, "kd.tail=renorm"], [heal, "kd.tail=ghost", "kd.temperature=2.0"],
                        [heal, "kd.alpha=0"], ["kd.alpha=0.5"], ["kd.alpha=0.5", "kd.tail=none"]):
            check_kd_config(kd_config(store, *options))
