"""The end-to-end demo: its corpus (the stdlib's or the user's), its metrics against independent references, bad
corpora refused before anything is touched, and the miniature pipeline run twice, from the checkout and from a
non-editable installation outside it (same seed -> same numbers; a used output folder is refused)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_kd_plugin.demo import data
from megatron_kd_plugin.demo.metrics import ECE_BINS, evaluate
from megatron_kd_plugin.demo.pipeline import PRESETS, main, prepare_output
from tests.test_packaging import install_package, outside_repo_env

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
MINI = PRESETS["mini"]


def _assert_split_by_name_hash(splits, cfg):
    assert not {d.name for d in splits["train"]} & {d.name for d in splits["heldout"]}
    assert all(data._name_hash(d.name) % cfg.heldout_every == 0 for d in splits["heldout"])
    assert all(data._name_hash(d.name) % cfg.heldout_every != 0 for d in splits["train"])


def test_split_is_by_whole_file_and_reproducible():
    root = data.stdlib_root()
    docs = data.stdlib_documents(root)
    assert docs == data.stdlib_documents(root)
    assert all(not {"site-packages", "dist-packages"} & set(pathlib.PurePath(d.name).parts) for d in docs)
    assert all(d.size == (root / d.name).stat().st_size for d in docs[:50])
    splits = data.split_documents(docs, MINI.corpus)
    _assert_split_by_name_hash(splits, MINI.corpus)
    assert sum(d.size for d in splits["train"][:-1]) < MINI.corpus.train_bytes


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
    assert len(docs) == first.stats["heldout"]["documents"]
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
    heldout = data.split_documents(data.stdlib_documents(), MINI.corpus)["heldout"]
    assert text == heldout[0].read()
    with pytest.raises(ValueError, match="too few"):
        data.token_windows(first.heldout_prefix, 10**7)


_WORDS = ("the a of to and in is it that was for on are with as his they be at one have this from or had by hot "
          "word but what some we can out other were all there when up use your how said an each she which do their "
          "time if will way about many then them write would like so these her long make thing see him two has look "
          "more day could go come did number sound no most people my over know water than call first who may down "
          "side been now find").split()


def _user_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents of English words, ~2 kB each, a few with non-ASCII text."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
                     for _ in range(40)]
        texts.append(f"Document {i}: " + " ".join(sentences) + (" Café, naïve — 東京.\n" if i % 7 == 0 else "\n"))
    return texts


def _write_folder(root: pathlib.Path, texts: list[str]) -> pathlib.Path:
    """One file per text, in two folders and three suffixes, plus a hidden folder and a non-text file to skip."""
    for i, text in enumerate(texts):
        path = root / ("notes" if i % 2 else "") / f"doc{i:02d}{data.TEXT_SUFFIXES[i % 3]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / ".cache").mkdir()
    (root / ".cache" / "skipped.txt").write_text("a hidden folder is not part of the corpus")
    (root / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return root


def test_user_corpus_folder_or_jsonl(tmp_path):
    texts = _user_texts(60)
    folder = _write_folder(tmp_path / "folder", texts)
    jsonl = tmp_path / "records.jsonl"
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    jsonl.write_text("\n".join(lines[:5] + ["   "] + lines[5:]) + "\n", encoding="utf-8")   # a blank line: skipped
    from tokenizers import Tokenizer

    for source in (folder, jsonl):
        cfg = dataclasses.replace(MINI.corpus, source=str(source))
        docs = data.corpus_documents(cfg)
        assert sorted(d.read() for d in docs) == sorted(texts)   # each text once; nothing hidden or non-text
        assert all(d.size == len(d.read().encode()) for d in docs)
        splits = data.split_documents(docs, cfg)
        _assert_split_by_name_hash(splits, cfg)
        corpus = data.build_corpus(tmp_path / f"built_{source.name}", cfg)
        assert corpus.stats["source"] == str(source)
        assert [corpus.stats[name]["documents"] for name in data.SPLITS] == [len(splits[n]) for n in data.SPLITS]
        assert sum(len(splits[n]) for n in data.SPLITS) == len(texts)    # all of it fits the mini byte budgets
        tokenizer = Tokenizer.from_file(str(corpus.tokenizer_path))
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        heldout = IndexedDataset(str(corpus.heldout_prefix))
        assert [tokenizer.decode(doc[:-1].tolist()) for doc in heldout] == [d.read() for d in splits["heldout"]]


def _bad_corpus(case: str, tmp: pathlib.Path) -> tuple[pathlib.Path, ...]:
    """A corpus the demo must refuse, then what its error line must say."""
    if case == "missing":
        return tmp / "nowhere", "no such file or folder"
    if case == "plain file":
        (tmp / "book.txt").write_text(_user_texts(1)[0])
        return tmp / "book.txt", "a file must be JSONL"
    if case == "no text files":
        (tmp / "pictures").mkdir()
        (tmp / "pictures" / "a.png").write_bytes(b"\x89PNG")
        return tmp / "pictures", "no text files"
    if case in ("bad json", "text not a string"):
        second = '{"text": "unterminated' if case == "bad json" else '{"text": 123}'
        (tmp / "c.jsonl").write_text('{"text": "fine"}\n' + second + "\n")
        return tmp / "c.jsonl", ":2: not JSON" if case == "bad json" else ":2: not a JSON object with a 'text' string"
    if case == "not utf-8":
        folder = _write_folder(tmp / "mixed", _user_texts(60))
        (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
        return folder, "latin1.txt: not UTF-8"
    if case == "one document":
        return _write_folder(tmp / "single", _user_texts(1)), "split is empty"
    # too little text: the error says how many tokens the cache (train split) or the eval (held-out) needs; with
    # one student step (8 cached samples) the train split holds enough, the held-out one not
    split = "heldout" if case == "too little held-out text" else "train"
    cfg = dataclasses.replace(PRESETS["default"], student_steps=1 if split == "heldout" else 150)
    label = "held-out" if split == "heldout" else "train"
    return (_write_folder(tmp / "small", _user_texts(60)),
            f"too little text: the {label} split", f"the demo needs {cfg.corpus_needs()[split][0]:,} (")


@pytest.mark.parametrize("case", ["missing", "plain file", "no text files", "bad json", "text not a string",
                                  "not utf-8", "one document", "too little text", "too little held-out text"])
def test_bad_corpus_is_refused_before_anything_is_touched(tmp_path, capsys, case):
    source, *expected = _bad_corpus(case, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous run")
    steps = ["--student-steps", "1"] if case == "too little held-out text" else []
    assert main(["--corpus", str(source), "--output", str(out), "--overwrite", *steps]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("demo:")]
    assert len(errors) == 1 and str(source) in errors[0] and all(e in errors[0] for e in expected), errors
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "previous run"


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


def _run_mini(folder: pathlib.Path, installed: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """The mini demo from the checkout, or with ``installed`` from that installation in a folder outside it."""
    env, cwd = ((dict(os.environ, PYTHONPATH=str(REPO_ROOT)), REPO_ROOT) if installed is None
                else (outside_repo_env(installed), folder.parent))
    return subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "demo", "--preset", "mini", "--output",
                           str(folder)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_mini_pipeline_end_to_end_twice(tmp_path):
    """Once from the checkout, once from a non-editable installation outside it (cache step included)."""
    runs = [tmp_path / "run1", tmp_path / "run2"]
    installed = install_package(tmp_path / "site")
    for folder, package in zip(runs, (None, installed)):
        done = _run_mini(folder, package)
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
