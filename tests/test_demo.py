"""The end-to-end demo: its corpus (the stdlib's or the user's), its metrics against independent references, bad
corpora refused before anything is touched, the compression against transformers' own forward, and the miniature
heal run once from a non-editable installation outside the checkout, its KD heal then rerun from the checkout by
the command the demo wrote (same seed -> same losses and weights; a used output folder is refused)."""

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
import zarr

from megatron_kd_plugin.demo import data
from megatron_kd_plugin.demo.metrics import ECE_BINS, evaluate
from megatron_kd_plugin.demo.pipeline import MODELS, PRESETS, HealConfig, cache_command, main
from megatron_kd_plugin.demo.scratch import prepare_output
from tests.test_packaging import outside_repo_env
from tests.distributed import scaled

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
    first = data.tokenize_corpus(MINI.corpus).save(tmp_path / "a")
    second = data.tokenize_corpus(MINI.corpus).save(tmp_path / "b")
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
    # spread windows: every (N // n)-th window, each target token with the document holding it
    all_windows = data.token_windows(first.heldout_prefix, 16)
    spread, documents = data.spread_windows(first.heldout_prefix, 16, 5)
    chosen = [i * len(all_windows) // 5 for i in range(5)]
    assert torch.equal(spread, all_windows[chosen])
    owner = np.concatenate([np.full(len(doc), d) for d, doc in enumerate(docs)])            # [stream]
    assert documents.tolist() == [owner[i * 16 + 1:i * 16 + 17].tolist() for i in chosen]
    assert documents.max() == len(docs) - 1 and len(data.spread_windows(first.heldout_prefix, 16, 10**6)[0]) == len(
        all_windows)


def test_corpus_fingerprint_names_the_text(tmp_path):
    """The same documents give the same sha256 (and the interpreter's version); one changed byte, a document moved
    to the other split or another stdlib folder (``--stdlib``) gives another."""
    import platform

    texts = _user_texts(60)
    cfg = dataclasses.replace(MINI.corpus, source=str(_write_folder(tmp_path / "a", texts)))
    splits = data.split_documents(data.corpus_documents(cfg), cfg)
    read = {name: [d.read() for d in docs] for name, docs in splits.items()}
    first = data.corpus_fingerprint(splits, read)
    assert first == data.corpus_fingerprint(splits, read) and first["python"] == platform.python_version()
    changed = dict(read, train=[read["train"][0] + " "] + read["train"][1:])
    moved = {"train": splits["train"][1:], "heldout": splits["train"][:1] + splits["heldout"]}
    assert len({first["sha256"], data.corpus_fingerprint(splits, changed)["sha256"],
                data.corpus_fingerprint(moved, {n: [d.read() for d in docs] for n, docs in moved.items()})["sha256"]}) == 3

    stdlib = tmp_path / "lib" / "python3.99"                     # another interpreter's stdlib: its *.py files
    for i, text in enumerate(texts):
        (stdlib / ("site-packages" if i == 0 else "") / f"module{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (stdlib / ("site-packages" if i == 0 else "") / f"module{i}.py").write_text(text)
    other = dataclasses.replace(MINI.corpus, stdlib=str(stdlib))
    assert sorted(d.name for d in data.corpus_documents(other)) == sorted(f"module{i}.py" for i in range(1, 60))
    with pytest.raises(data.CorpusError, match="no such folder"):
        data.corpus_documents(dataclasses.replace(MINI.corpus, stdlib=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="two corpora"):
        dataclasses.replace(other, source=str(tmp_path))


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
        corpus = data.tokenize_corpus(cfg).save(tmp_path / f"built_{source.name}")
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
    # one heal step (8 cached samples) the train split holds enough, the held-out one not
    split = "heldout" if case == "too little held-out text" else "train"
    cfg = dataclasses.replace(PRESETS["default"], heal_steps=1 if split == "heldout" else PRESETS["default"].heal_steps)
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
    steps = ["--heal-steps", "1"] if case == "too little held-out text" else []
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
    documents = torch.randint(0, 4, (n, s), generator=gen)
    result = evaluate({"student": student}, teacher, samples, documents=documents, micro_batch_size=2)

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
    per_token_nll = F.nll_loss(lq, targets, reduction="none")
    per_token_kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)
    by_document = got["by_document"]                                         # sums over each document's tokens
    for d in range(4):
        mine = documents.flatten() == d
        assert by_document["tokens"][d] == mine.sum()
        assert by_document["nll"][d] == pytest.approx(float(per_token_nll[mine].sum()), rel=1e-5)
        assert by_document["kl"][d] == pytest.approx(float(per_token_kl[mine].sum()), rel=1e-5, abs=1e-6)
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


def test_the_layout_reaches_the_cache_command_and_another_is_refused(tmp_path):
    corpus = type("Corpus", (), {"train_prefix": tmp_path / "train"})
    for layout in ("stream", "packed"):
        command = cache_command(dataclasses.replace(MINI, layout=layout), corpus, tmp_path / "t", tmp_path / "s")
        assert command[command.index("--layout") + 1] == layout
        assert command[command.index("--num-samples") + 1] == str(MINI.cache_samples)   # as many rows in both
    with pytest.raises(ValueError, match="HealConfig.layout must be one of stream, packed, got 'document'"):
        HealConfig(layout="document")


def test_compression_keeps_the_chosen_layers_and_most_active_mlp_channels(tiny_hf_qwen3):
    """The pruned student equals, under transformers, the teacher with those layers removed and the other MLP
    channels' weights zeroed (a zeroed channel adds nothing): an independent construction of the same model."""
    import transformers

    from megatron_kd_plugin.demo import qwen3_models

    teacher = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_qwen3, dtype=torch.float64).eval()
    calibration = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    student = qwen3_models.compress(teacher, (1,), 0.25, calibration)
    assert (student.config.num_hidden_layers, student.config.intermediate_size) == (1, 32)
    importance = qwen3_models.mlp_channel_importance(teacher, calibration)[1]                  # [128]
    kept = importance.argsort(descending=True)[:32]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_qwen3, dtype=torch.float64).eval()
    mlp = reference.model.layers[1].mlp
    dropped = torch.ones(128, dtype=torch.bool)
    dropped[kept] = False
    with torch.no_grad():
        mlp.down_proj.weight[:, dropped] = 0
    reference.model.layers = reference.model.layers[1:]
    reference.config.num_hidden_layers = 1
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids=tokens, use_cache=False).logits,
                                   reference(input_ids=tokens, use_cache=False).logits)
    with pytest.raises(ValueError, match="keep_layers"):
        qwen3_models.compress(teacher, (1, 0), 0.5, calibration)


def test_mini_heal_end_to_end_from_an_installation_and_its_kd_heal_rerun_from_the_checkout(tmp_path,
                                                                                         installed_package):
    """The whole mini demo in a fresh process from a non-editable installation outside the checkout (the package's
    own cache / plan / train commands under it); then its KD heal command, as the demo wrote it to commands.sh, run
    again from the checkout: the same losses and the same exported weights, to the last bit."""
    import shlex

    from safetensors.torch import load_file

    folder = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "demo", "--preset", "mini", "--output",
                           str(folder)], cwd=tmp_path, env=outside_repo_env(installed_package), capture_output=True,
                          text=True, timeout=scaled(900))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((folder / "metrics.json").read_text())
    metrics = result["metrics"]
    assert set(metrics) == {*MODELS, "unigram"}
    outcome, corpus = result["outcome"], result["corpus"]        # the verdict's intervals and the corpus's fingerprint
    low, high = outcome["kd_vs_ce_perplexity_interval"]
    assert low <= outcome["kd_vs_ce_perplexity"] <= high and outcome["documents_resampled"] >= 1
    assert outcome["verdict"].startswith("KD beats CE" if high < 0 and outcome["kd_minus_ce_kl_interval"][1] < 0
                                         else "KD does NOT beat CE")
    assert corpus["source"].startswith("stdlib:") and len(corpus["sha256"]) == 64 and corpus["python"]
    assert corpus["sha256"][:16] in (folder / "results.md").read_text()
    rows = result["rows"]                                   # the default: whole files packed into rows
    assert rows["layout"] == "packed" and rows["rows"] == MINI.cache_samples and rows["packing"]["documents"] >= 1
    assert rows["packing"]["pieces"] >= MINI.cache_samples        # a row holds one piece or more, each of >1 token
    loss_mask = zarr.open_group(str(folder / "cache.zarr"), mode="r")["loss_mask"][:]
    assert loss_mask.shape == (MINI.cache_samples, MINI.seq_length)
    assert rows["loss_targets"] == int(loss_mask.sum()) <= MINI.cache_samples * MINI.seq_length
    assert f"Heal rows: packed, {MINI.cache_samples:,} rows" in (folder / "results.md").read_text()
    assert metrics["teacher"]["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["teacher"]["perplexity"] < metrics["unigram"]["perplexity"]     # the teacher learnt something
    kd, ce, pruned = metrics["healed KD"], metrics["healed CE"], metrics["pruned"]
    assert kd["kl_to_teacher"] < ce["kl_to_teacher"] and kd["kl_to_teacher"] < pruned["kl_to_teacher"]
    for m in (metrics[name] for name in MODELS):
        assert 1 < m["perplexity"] and 0 <= m["ece"] <= 1
    assert result["params"]["student"] < result["params"]["teacher"]
    history = json.loads((folder / "history.json").read_text())
    assert len(history["heal_kd"]) == len(history["heal_ce"]) == MINI.heal_steps
    assert "kd loss" in history["heal_kd"][0] and "lm loss" in history["heal_ce"][0]
    for name in ("results.png", "results.md", "plan.txt", "commands.sh", "teacher/config.json",
                 "teacher/tokenizer.json", "student_pruned/model.safetensors", "healed_kd/model.safetensors",
                 "healed_ce/model.safetensors", "cache.zarr", "heal_kd/tb_logs/history.jsonl"):
        assert (folder / name).exists(), name
    assert (folder / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert all(name in (folder / "results.md").read_text() for name in (*MODELS, "unigram"))
    assert f"planned: seq_length={MINI.seq_length}, micro_batch_size={MINI.micro_batch_size}" in (
        folder / "plan.txt").read_text()
    assert "iteration" in (folder / "heal_kd.log").read_text()

    heal = next(line for line in (folder / "commands.sh").read_text().splitlines()
                if " train " in line and "kd.alpha=0.0" not in line)
    rerun = tmp_path / "rerun"
    threads, python, *arguments = shlex.split(heal)                # OMP_NUM_THREADS=N python -m megatron_kd_plugin ...
    assert threads.startswith("OMP_NUM_THREADS=") and python == "python", heal
    arguments = [arg.replace(str(folder / "heal_kd"), str(rerun)) for arg in arguments]
    again = subprocess.run([sys.executable, *arguments], cwd=REPO_ROOT, capture_output=True, text=True, timeout=scaled(600),
                           env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS=threads.split("=")[1]))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    from megatron_kd_plugin.bridge.cpu_log import read_history

    assert read_history(rerun / "tb_logs") == history["heal_kd"]
    exported = load_file(folder / "healed_kd" / "model.safetensors")
    rerun_weights = load_file(rerun / "checkpoints" / f"iter_{MINI.heal_steps:07d}" / "hf" / "model.safetensors")
    assert exported.keys() == rerun_weights.keys()
    assert all(torch.equal(exported[key], rerun_weights[key]) for key in exported)

    assert main(["--preset", "mini", "--output", str(folder)]) == 2   # a finished run is not overwritten
    assert json.loads((folder / "metrics.json").read_text()) == result
