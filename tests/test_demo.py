"""The end-to-end demo: its corpus, its metrics against independent references, and the miniature pipeline run
twice (same seed -> same numbers; the second run into the same folder is refused without --overwrite)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_kd_plugin.demo import data
from megatron_kd_plugin.demo.metrics import ECE_BINS, evaluate
from megatron_kd_plugin.demo.pipeline import PRESETS, main, prepare_output

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
MINI = PRESETS["mini"]


def test_split_is_by_whole_file_and_reproducible():
    root = data.stdlib_root()
    files = data.stdlib_source_files(root)
    assert files == data.stdlib_source_files(root)
    assert all(not {"site-packages", "dist-packages"} & set(f.parts) for f in files)
    splits = data.split_by_file(files, root, MINI.corpus)
    assert not set(splits["train"]) & set(splits["heldout"])
    assert all(data._path_hash(f) % MINI.corpus.heldout_every == 0 for f in splits["heldout"])
    assert all(data._path_hash(f) % MINI.corpus.heldout_every != 0 for f in splits["train"])
    assert sum((root / f).stat().st_size for f in splits["train"][:-1]) < MINI.corpus.train_bytes


def test_corpus_files_are_deterministic_and_readable(tmp_path):
    first = data.build_corpus(tmp_path / "a", MINI.corpus)
    second = data.build_corpus(tmp_path / "b", MINI.corpus)
    for name in ("tokenizer.json", "train.bin", "train.idx", "heldout.bin", "heldout.idx"):
        assert (first.folder / name).read_bytes() == (second.folder / name).read_bytes(), name
    loaded = data.DemoCorpus.load(first.folder)
    assert loaded.vocab_size == first.vocab_size <= MINI.corpus.vocab_size and loaded.eod_id == 0
    # megatron-core's reader sees one document per file, each ending in EOD
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = IndexedDataset(str(first.heldout_prefix))
    assert len(docs) == first.stats["heldout"]["files"]
    assert all(doc[-1] == first.eod_id and first.eod_id not in doc[:-1] for doc in docs)
    assert sum(len(doc) for doc in docs) == first.stats["heldout"]["tokens"]
    # windows overlap by one token and decode back to the stdlib's text
    windows = data.token_windows(first.heldout_prefix, 16)
    assert windows.shape[1] == 17 and torch.equal(windows[1:, 0], windows[:-1, -1])
    stream = np.concatenate(list(docs))
    assert torch.equal(windows.flatten()[:17], torch.from_numpy(stream[:17].astype(np.int64)))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(first.tokenizer_path))
    text = tokenizer.decode(docs[0][:-1].tolist())
    root = data.stdlib_root()
    heldout = data.split_by_file(data.stdlib_source_files(root), root, MINI.corpus)["heldout"]
    assert text == data.read_sources(root, heldout[:1])[0]
    with pytest.raises(ValueError, match="too few"):
        data.token_windows(first.heldout_prefix, 10**7)


class _FixedLogits(torch.nn.Module):
    """A "model" whose logits for token x at any position are row x of a table: [b, s] -> [b, s, V]."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, tokens, position_ids, attention_mask):
        return self.table[tokens]


def test_metrics_match_independent_references():
    gen = torch.Generator().manual_seed(0)
    vocab, n, s = 37, 5, 9
    teacher = _FixedLogits(3 * torch.randn(vocab, vocab, generator=gen))
    student = _FixedLogits(2 * torch.randn(vocab, vocab, generator=gen))
    samples = torch.randint(0, vocab, (n, s + 1), generator=gen)
    result = evaluate({"student": student}, teacher, samples, micro_batch_size=2)

    inputs, targets = samples[:, :-1].flatten(), samples[:, 1:].flatten()
    lq = torch.log_softmax(student.table.double()[inputs], -1)
    lp = torch.log_softmax(teacher.table.double()[inputs], -1)
    nll = F.nll_loss(lq, targets)
    kl = F.kl_div(lq, lp, log_target=True, reduction="batchmean")
    conf, pred = lq.exp().max(-1)
    ece = 0.0
    for b in range(ECE_BINS):
        lo, hi = b / ECE_BINS, (b + 1) / ECE_BINS
        in_bin = (conf >= lo) & ((conf < hi) if b < ECE_BINS - 1 else (conf <= hi))
        if in_bin.any():
            ece += in_bin.double().mean() * abs((pred[in_bin] == targets[in_bin]).double().mean() - conf[in_bin].mean())
    got = result["student"]
    assert got["tokens"] == n * s
    assert got["perplexity"] == pytest.approx(float(nll.exp()), rel=1e-5)
    assert got["kl_to_teacher"] == pytest.approx(float(kl), rel=1e-5)
    assert got["ece"] == pytest.approx(float(ece), rel=1e-5, abs=1e-7)
    assert result["teacher"]["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6)
    assert student.training and teacher.training   # evaluate restores each model's mode


def test_refuses_a_used_output_folder(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "keep.txt").write_text("previous run")
    assert main(["--preset", "mini", "--output", str(folder)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (folder / "keep.txt").read_text() == "previous run"
    prepare_output(folder, overwrite=True)
    assert folder.is_dir() and not any(folder.iterdir())


def _run_mini(folder: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "demo", "--preset", "mini", "--output",
                           str(folder)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_mini_pipeline_end_to_end_twice(tmp_path):
    runs = [tmp_path / "run1", tmp_path / "run2"]
    for folder in runs:
        done = _run_mini(folder)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = [json.loads((folder / "metrics.json").read_text()) for folder in runs]
    assert results[0]["metrics"] == results[1]["metrics"]   # same seed, same numbers, to the last bit
    histories = [json.loads((folder / "history.json").read_text()) for folder in runs]
    assert histories[0] == histories[1]

    metrics = results[0]["metrics"]
    assert set(metrics) == {"teacher", "student from cache (KD)", "student CE only"}
    kd, ce = metrics["student from cache (KD)"], metrics["student CE only"]
    assert metrics["teacher"]["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6)
    assert kd["kl_to_teacher"] < ce["kl_to_teacher"]   # distillation moved the student towards the teacher
    for m in metrics.values():
        assert 1 < m["perplexity"] < 2 * MINI.corpus.vocab_size and 0 <= m["ece"] <= 1
    teacher_losses = [h["loss"] for h in histories[0]["teacher"]]
    assert np.mean(teacher_losses[-5:]) < np.mean(teacher_losses[:5])
    assert len(histories[0]["student_kd"]) == len(histories[0]["student_ce"]) == MINI.student_steps

    folder = runs[0]
    for name in ("loss_curves.png", "results.md", "data/tokenizer.json", "data/train.bin", "data/train.idx",
                 "teacher", "cache.zarr"):
        assert (folder / name).exists(), name
    assert (folder / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    table = (folder / "results.md").read_text()
    assert all(name in table for name in metrics)
    assert main(["--preset", "mini", "--output", str(folder)]) == 2   # a finished run is not overwritten
    assert json.loads((folder / "metrics.json").read_text()) == results[0]
