"""tools/cache_teacher_logits.py end to end: torchrun TP=2 on an indexed dataset against a float64 TP=1
reference; real SIGKILLs of a torchrun DP=2 run (torchrun and its workers) writing a packed store of prompt/response
pairs at known shard boundaries (the workers pause themselves there: ``tests/paused_cache_tool.py``), a second run
refused while orphaned workers live, and a resume, byte-identical to one clean single-process run; bad data, bad
documents and teacher files, each one line with nothing written."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.layouts import open_rows
from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.writer import describe_packing
from megatron_kd_plugin.models.gpt import GPTSpec
from tests.chat_tokenizers import PLAIN_TEMPLATE, save_tokenizer, save_tokenizer_json
from tests.distributed import run_on_ranks, scaled

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "cache_teacher_logits.py"
PAUSED_TOOL = ROOT / "tests" / "paused_cache_tool.py"   # the same command, stopping itself at a shard boundary
SPEC = GPTSpec(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
               seq_length=16)
S, K = 16, 8
PAIR_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"
"""The characters of the pairs' tokenizer: 4 specials + 60 = the teacher's 64 ids."""


def _make_teacher_and_reference(folder, prefix, num_samples):
    """Saves a seeded teacher and an indexed dataset; returns float64 log-softmax of each window's rows."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron_kd_plugin.models.gpt import build_gpt, gpt_logits, save_gpt

    seed_model_parallel(3)
    model = build_gpt(SPEC, tp_size=1)
    with torch.no_grad():                       # sharpen the toy teacher: peaked, tie-free distributions
        model.output_layer.weight.mul_(40.0)
    save_gpt(model, SPEC, folder)
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for length in rng.integers(5, 40, 60):
        builder.add_document(rng.integers(0, SPEC.vocab_size, length).astype(np.int32), [int(length)])
    builder.finalize(prefix + ".idx")
    from megatron_kd_plugin.cache.sources.token_windows import indexed_dataset_windows

    source = indexed_dataset_windows(prefix, S, num_samples=num_samples)
    tokens = torch.from_numpy(source.windows(0, num_samples))
    with torch.no_grad():
        return tokens, torch.log_softmax(gpt_logits(model, tokens[:, :-1]).double(), dim=-1).transpose(0, 1)


def _cache_command(teacher, prefix, output, *extra, nproc=None):
    """The tool's command line: under torchrun with ``nproc`` processes, else one plain process."""
    launcher = [sys.executable] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return launcher + [str(TOOL), "--teacher", str(teacher), "--data", prefix, "--output", str(output),
                       "--seq-length", str(S), "--topk", str(K), "--no-progress", *extra]


def _env(nproc):
    """One thread per process: the same float results whatever the process count (DP=2 vs one process)."""
    return dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def teacher_and_data(tmp_path_factory):
    work = tmp_path_factory.mktemp("tool")
    tokens, logprobs = run_on_ranks(1, _make_teacher_and_reference, str(work / "teacher"), str(work / "data"),
                                    24)[0]
    return work, tokens, logprobs


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(JSONL of prompt/response pairs, their tokenizer.json): 90 pairs of 2 to 21 tokens with the end-of-document
    id, packed several to a row of S = 16, and 4 of 29 tokens whose first piece of a row is all prompt (dropped)."""
    import json

    work = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(1)

    def text(length):
        return "".join(rng.choice(list(PAIR_CHARACTERS), int(length)))

    records = [{"prompt": text(rng.integers(0, 12)), "response": text(rng.integers(1, 10))} for _ in range(90)]
    for i in (5, 30, 55, 80):
        records[i] = {"prompt": text(25), "response": text(3)}
    (work / "pairs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(work / "pairs.jsonl"), save_tokenizer_json(work / "pairs_tokenizer.json", PAIR_CHARACTERS)


def test_torchrun_tp2_store_matches_a_float64_tp1_reference_and_refuses_bad_settings(teacher_and_data):
    work, tokens, logprobs = teacher_and_data
    output = work / "tp2.zarr"
    result = subprocess.run(_cache_command(work / "teacher", str(work / "data"), output, "--tp", "2",
                                           "--num-samples", "10", "--micro-batch-size", "3",
                                           "--logprob-codec", "fp32", "--samples-per-shard", "4", nproc=2),
                            env=_env(2), capture_output=True, text=True, timeout=scaled(600))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "overhead (total / plain forward)" in result.stdout and "bytes/token" in result.stdout
    reader = TopKCacheReader(output)
    reader.validate(vocab_size=SPEC.vocab_size, seq_length=S, k=K)
    assert len(reader) == 10 and reader.spec.teacher.startswith("teacher:sha256=")
    for i in range(10):
        sample = reader[i]
        assert torch.equal(sample.tokens, tokens[i])
        ref = logprobs[i]                                                              # [S, V]
        ids = torch.sort(ref, dim=-1, descending=True, stable=True).indices[:, :K].sort(dim=-1).values
        assert torch.equal(sample.teacher.ids, ids)
        torch.testing.assert_close(sample.teacher.logprobs.double(), ref.gather(-1, ids), atol=2e-5, rtol=0)
    refused = subprocess.run(_cache_command(work / "teacher", str(work / "data"), output, "--num-samples", "10",
                                            "--topk", "4"), env=_env(1), capture_output=True, text=True, timeout=scaled(600))
    assert refused.returncode != 0 and "pass --overwrite" in refused.stderr and "k: requested 4" in refused.stderr
    pp = subprocess.run(_cache_command(work / "teacher", str(work / "data"), work / "pp.zarr", "--pp", "2"),
                        env=_env(1), capture_output=True, text=True, timeout=scaled(600))
    assert pp.returncode != 0 and "pipeline parallelism is not supported" in pp.stderr


def test_torchrun_tp2_cross_tokenizer_store_holds_realised_logprobs_and_the_byte_table(teacher_and_data):
    """``--cross-tokenizer`` at TP=2: each token's realised log-prob equals the float64 reference (in the top-K or
    not) and the store holds the tokenizer's byte table; without a tokenizer the option is refused."""
    from tokenizers import Tokenizer, models

    work, tokens, logprobs = teacher_and_data
    tokenizer = work / "letters.json"
    Tokenizer(models.WordLevel({chr(0x41 + i) if i < 32 else chr(0x3b1 + i - 32): i
                                for i in range(SPEC.vocab_size)}, unk_token="A")).save(str(tokenizer))
    output = work / "xtok.zarr"
    result = subprocess.run(_cache_command(work / "teacher", str(work / "data"), output, "--tp", "2",
                                           "--num-samples", "6", "--logprob-codec", "fp32", "--cross-tokenizer",
                                           "--tokenizer", str(tokenizer), nproc=2),
                            env=_env(2), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reader = TopKCacheReader(output)
    table = reader.vocab_table()
    assert table.strings[3] == b"D" and table.strings[40] == "\u03b9".encode()   # two-byte UTF-8 letters too
    for i in range(6):
        realised = logprobs[i].gather(-1, tokens[i][1:, None]).squeeze(-1)            # [S]
        torch.testing.assert_close(reader[i].realised_logprob.double(), realised, atol=2e-5, rtol=0)
    from megatron_kd_plugin.commands.cache import cross_tokenizer_table, parse_args

    args = parse_args(["--teacher", "t", "--data", "d", "--output", "o", "--seq-length", "4", "--cross-tokenizer"])
    with pytest.raises(ValueError, match="--cross-tokenizer needs the teacher's tokenizer"):
        cross_tokenizer_table(args, None, SPEC.vocab_size)


def _done(output) -> int:
    """Shards written: their records files (written last, each by an atomic rename); -1 before creation."""
    if not (pathlib.Path(output) / "zarr.json").exists():
        return -1
    return sum(not fmt.is_partial(file) for file in (pathlib.Path(output) / fmt.RECORDS).glob("c.*"))


def _kill_paused(command, output, pause_after, *, orphan_workers=False, timeout=scaled(600)):
    """Starts the torchrun ``command`` with each worker stopping itself (SIGSTOP: ``tests/paused_cache_tool.py``
    passes the command a callback) once it has written ``pause_after`` shards in this run, waits until both are stopped
    (a shard boundary, whatever the machine's speed), then SIGKILLs torchrun's process group and every worker
    (torch elastic starts each in its own session: killing torchrun's group alone leaves them running).
    ``orphan_workers``: kill torchrun's group only, as ``kill -9 -PGID`` does, and return its stopped workers, still
    alive when a second run starts; else return []."""
    tool = command.index(str(TOOL))
    command = command[:tool] + [str(PAUSED_TOOL), str(pause_after)] + command[tool + 1:]
    proc = subprocess.Popen(command, env=_env(2),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            workers = psutil.Process(proc.pid).children(recursive=True)
            if len(workers) == 2 and all(worker.status() == psutil.STATUS_STOPPED for worker in workers):
                break
        except psutil.NoSuchProcess:
            pass
        if proc.poll() is not None:
            errors = [line for line in proc.stderr.read().decode().splitlines() if "error:" in line]
            raise AssertionError(f"the tool ended before its workers paused: {errors[-5:]}")
        assert time.monotonic() < deadline, "the workers did not pause in time"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    for worker in () if orphan_workers else workers:
        worker.kill()
    proc.wait()
    if orphan_workers:
        assert all(map(_alive, workers))
        return workers
    _wait_dead(workers)
    return []


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(processes, timeout=scaled(30)):
    deadline = time.monotonic() + timeout
    while any(map(_alive, processes)):
        assert time.monotonic() < deadline, processes
        time.sleep(0.01)


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_sigkill_of_torchrun_runs_then_a_resume_are_byte_identical_to_a_clean_run(teacher_and_data, pairs):
    """A packed store of prompt/response pairs (loss mask 0 on prompts and document ends, positions restarting):
    three kills of a torchrun DP=2 run; the third orphans the workers, and a second run is refused while they live.
    The resume (one process) completes a store written by two DP writers and four runs, byte for byte the store of
    one clean single-process run; so does ``--repair`` of a damaged shard."""
    work, _, _ = teacher_and_data
    data, tokenizer = pairs
    args = ("--num-samples", "32", "--samples-per-shard", "2", "--micro-batch-size", "1", "--layout", "packed",
            "--tokenizer", tokenizer)
    clean, killed = work / "clean.zarr", work / "killed.zarr"
    plain = _cache_command(work / "teacher", data, killed, *args)
    first = subprocess.run(_cache_command(work / "teacher", data, clean, *args), env=_env(1), capture_output=True,
                           text=True, timeout=scaled(600))
    assert first.returncode == 0, first.stderr[-3000:]
    packing = open_rows(data, S, tokenizer=tokenizer, layout="packed", num_samples=32).packing
    assert packing["dropped"] == 4 and packing["documents"] > 32           # the 4 all-prompt pieces; packed rows
    assert f"[cache] layout packed: {describe_packing(packing)}" in first.stdout
    assert TopKCacheReader(clean).spec.layout == "packed"
    dp2 = _cache_command(work / "teacher", data, killed, *args, nproc=2)   # DP=2 writers
    marks = []
    for pause_after in (0, 2):                             # right after creation, then after 2 shards per rank
        _kill_paused(dp2, killed, pause_after)
        marks.append(_done(killed))
    orphans = _kill_paused(dp2, killed, 2, orphan_workers=True)
    try:
        second = subprocess.run(plain, env=_env(1), capture_output=True, text=True, timeout=scaled(600))
    finally:                                               # then the orphans die too, wherever they were (and
        for worker in orphans:                             # never outlive a failing test, paused)
            worker.kill()
    assert second.returncode != 0 and f"another run is writing {killed}" in second.stderr, second.stderr[-2000:]
    _wait_dead(orphans)
    marks.append(_done(killed))
    assert marks == [0, 4, 8], marks                        # each kill at a known shard boundary
    with pytest.raises(ValueError, match="unfinished"):
        TopKCacheReader(killed)
    resumed = subprocess.run(plain, env=_env(1), capture_output=True, text=True, timeout=scaled(600))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _tree(killed) == _tree(clean)
    assert not list(killed.rglob("*.partial"))
    shard = killed / fmt.IDS / "c.3.0.0"                              # damage, then the command's --repair
    shard.write_bytes(shard.read_bytes()[:-3])
    repaired = subprocess.run(plain + ["--repair"], env=_env(1), capture_output=True, text=True,
                              timeout=scaled(600))
    assert repaired.returncode == 0 and "1 of 16 written shards of samples [0, 32) damaged, rewriting them" in \
        repaired.stdout, \
        repaired.stderr[-3000:]
    assert _tree(killed) == _tree(clean)


@pytest.mark.parametrize("changed,named", [
    (dict(layout="document", split_documents=True), "layout: requested 'document', on disk 'packed'"),
    (dict(prompt_loss=True), "fingerprint (of the data and how they are cut into rows: input kind, layout, loss-mask "
                             "and split settings): requested")], ids=["layout", "masks"])
def test_a_resume_with_another_layout_or_mask_setting_is_refused_in_one_line(pairs, tmp_path, changed, named):
    """The store's identity holds the layout and the fingerprint of its rows (their mask and split settings): a
    rerun that would write other rows is refused, one line naming the difference, the store untouched."""
    from megatron_kd_plugin.cache.writer import write_cache

    data, tokenizer = pairs
    table = torch.randn(SPEC.vocab_size, SPEC.vocab_size, generator=torch.Generator().manual_seed(0))
    teacher = lambda tokens, position_ids: table[tokens].transpose(0, 1)                # noqa: E731 (context-free)
    options = dict(k=K, vocab_size=SPEC.vocab_size, teacher="table", samples_per_shard=4, progress=False)
    rows = dict(tokenizer=tokenizer, layout="packed", num_samples=8)
    write_cache(open_rows(data, S, **rows), teacher, tmp_path / "s.zarr", **options)
    before = _tree(tmp_path / "s.zarr")
    with pytest.raises(ValueError, match="already holds a store written with other settings") as refused:
        write_cache(open_rows(data, S, **rows | changed), teacher, tmp_path / "s.zarr", **options)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert _tree(tmp_path / "s.zarr") == before


BAD_DOCUMENTS = {   # JSONL records, tokenizer ("json": no chat template; "chat": one), extra flags, the error
    "messages without a chat template": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}], "json", (),
        "error: tokenizer 'tokenizer.json:sha256=.*' has no chat template: conversations \\(`messages`\\) are "
        "rendered by one"),
    "no assistant turn": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
         {"messages": [{"role": "user", "content": "hi"}]}], "chat", (),
        "error: .*bad.jsonl:2: the conversation has no assistant turn: no token of it would be a loss target"),
    "a document longer than S": (
        [{"text": "short"}, {"text": "x" * 20}], "json", ("--layout", "document"),
        "error: .*bad.jsonl:2: a document of 21 tokens is longer than a row of seq_length=16 \\(\\+1\\) \\(1 such "
        "documents\\): raise the seq_length or ask for splitting documents"),
    "no loss target in any row": (
        [{"text": ""}, {"text": ""}], "json", ("--layout", "packed"),
        "error: .*bad.jsonl: no document has a loss target in any row of seq_length=16"),
    "prompt loss on a stream": (
        [{"text": "abc"}], "json", ("--prompt-loss",),
        "error: eod_loss=1,prompt_loss=1, split_documents=0: the 'stream' layout counts every label and splits "
        "nothing"),
    "--cp with packed rows": (
        [{"text": "abc"}], "json", ("--layout", "packed", "--cp", "2"),
        "error: --cp=2 with --layout packed: context parallelism with rows of several documents is not supported"),
    "--cp with conversations (packed by default)": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}], "chat",
        ("--cp", "2"), "error: --cp=2 with --layout packed: "),
}


@pytest.mark.parametrize("name", BAD_DOCUMENTS)
def test_bad_documents_are_one_line_before_the_teacher_loads_and_nothing_is_written(teacher_and_data, tmp_path,
                                                                                       capsys, name):
    """The command in-process: exit 2, one ``error:`` line on stderr, no traceback, nothing at ``--output``."""
    import json
    import re

    from megatron_kd_plugin.commands.cache import main

    records, tokenizer, extra, message = BAD_DOCUMENTS[name]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    tokenizer = save_tokenizer_json(tmp_path / "tokenizer.json") if tokenizer == "json" else \
        save_tokenizer(tmp_path / "chat", PLAIN_TEMPLATE)
    output = tmp_path / "out.zarr"
    assert main(["--teacher", str(teacher_and_data[0] / "teacher"), "--data", str(data), "--output", str(output),
                 "--seq-length", str(S), "--tokenizer", tokenizer, "--no-progress", *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(message, errors[0]), errors
    assert not output.exists()


def test_a_truncated_bin_file_is_named(teacher_and_data, tmp_path):
    from megatron_kd_plugin.cache.sources.token_windows import indexed_dataset_windows

    work = teacher_and_data[0]
    shutil.copy(work / "data.idx", tmp_path / "d.idx")
    (tmp_path / "d.bin").write_bytes((work / "data.bin").read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"{tmp_path / 'd.bin'} holds [0-9]+ bytes but {tmp_path / 'd.idx'} "
                                         "describes [0-9]+ tokens of int32 .*: the .bin is truncated"):
        indexed_dataset_windows(str(tmp_path / "d"), S)


def test_torchrun_tp2_sampled_store_matches_float64_tp1_draws_and_inspect_shows_the_mode(teacher_and_data, capsys):
    from megatron_kd_plugin.commands.inspect import main as inspect_main
    from megatron_kd_plugin.cache.kinds.draws import draw_uniforms, draw_weights, vocab_parallel_draws

    work, tokens, logprobs = teacher_and_data
    output, n, t = work / "sampled_tp2.zarr", 16, 1.5
    command = [arg for arg in _cache_command(work / "teacher", str(work / "data"), output, "--tp", "2",
                                             "--num-samples", "6", "--micro-batch-size", "4",
                                             "--logprob-codec", "fp32", "--samples-per-shard", "4", nproc=2)
               if arg not in ("--topk", str(K))] + ["--draws", str(n), "--proposal-temperature", str(t),
                                                    "--draw-seed", "3"]
    result = subprocess.run(command, env=_env(2), capture_output=True, text=True, timeout=scaled(600))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sampled, N=16 draws per token" in result.stdout
    reader = TopKCacheReader(output)
    reader.validate(vocab_size=SPEC.vocab_size, seq_length=S, k=n, mode="sampled")
    mismatched = 0
    for i in range(6):
        sample, ref = reader[i], logprobs[i]                                           # ref: float64 [S, V]
        draw = vocab_parallel_draws(ref.unsqueeze(1), draw_uniforms(3, i, 1, S, n), proposal_temperature=t)
        mismatched += int((sample.teacher.ids != draw.ids[:, 0]).sum())
        torch.testing.assert_close(sample.teacher.logprobs.double(), ref.gather(-1, sample.teacher.ids),
                                   atol=2e-5, rtol=0)
        expected = draw_weights(ref.gather(-1, sample.teacher.ids), torch.logsumexp(ref / t, dim=-1), t)
        torch.testing.assert_close(sample.teacher.weights, expected.float(), atol=1e-6, rtol=1e-4)
    # float32 TP=2 logits vs the float64 TP=1 reference: a draw may flip only when its uniform falls within
    # ~1e-6 of a CDF step (the TP=2 == TP=1 identity on equal logits is tests/test_cache_draws.py's)
    assert mismatched <= 0.01 * 6 * S * n, mismatched
    assert inspect_main([str(output), "--samples", "6"]) == 0
    assert "mode: sampled, N=16 draws per token, proposal temperature 1.5" in capsys.readouterr().out


def test_head_and_draws_store_holds_the_exact_head_then_draws_of_the_rest(teacher_and_data, capsys):
    """``--head 3 --draws 12`` (one process): each row's first 3 slots are the float64 reference's top-3, the 12 draws
    lie outside them with their full-vocab log-probs, the rows read as a SampledTeacher whose weights sum to 1."""
    from megatron_kd_plugin.cache.rows.row_kinds import row_kind
    from megatron_kd_plugin.commands.inspect import main as inspect_main
    from megatron_kd_plugin.loss import SampledTeacher

    work, tokens, logprobs = teacher_and_data
    output, head, n = work / "head_draws.zarr", 3, 12
    command = [arg for arg in _cache_command(work / "teacher", str(work / "data"), output, "--num-samples", "4",
                                             "--logprob-codec", "fp32") if arg not in ("--topk", str(K))]
    result = subprocess.run(command + ["--head", str(head), "--draws", str(n)], env=_env(1), capture_output=True,
                            text=True, timeout=scaled(600))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the top-3 ids then N=12 draws from the rest" in result.stdout
    reader = TopKCacheReader(output)
    assert reader.spec.head == head and reader.spec.k == head + n
    for i in range(4):
        sample, ref = reader[i], logprobs[i]                                           # ref: float64 [S, V]
        top = torch.sort(ref, dim=-1, descending=True, stable=True).indices[:, :head].sort(dim=-1).values
        assert torch.equal(sample.teacher.ids[:, :head], top)
        assert not (sample.teacher.ids[:, head:, None] == top[:, None, :]).any()
        torch.testing.assert_close(sample.teacher.logprobs.double(), ref.gather(-1, sample.teacher.ids),
                                   atol=2e-5, rtol=0)
        torch.testing.assert_close(sample.teacher.weights.sum(-1), torch.ones(S), atol=1e-5, rtol=0)
    teacher = row_kind(reader, seq_length=S).row(0, 0).teacher
    assert isinstance(teacher, SampledTeacher)
    torch.testing.assert_close(teacher.weights, reader[0].teacher.weights)
    assert inspect_main([str(output), "--samples", "4"]) == 0
    assert "mode: head + draws, the top-3 ids then N=12 draws from the rest per token" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--topk", "4", "--draws", "8"], "exclude each other"),
    (["--head", "4"], "only apply to a sampled store"),
    (["--draws", "8", "--head", "0"], "--head=0"),
    (["--draws", "8", "--head", "2", "--proposal-temperature", "2"], "follow the teacher itself"),
    (["--proposal-temperature", "2"], "only apply to a sampled store"),
    (["--draws", "0"], "--draws=0"),
    (["--draws", "8", "--proposal-temperature", "-1"], "expected > 0"),
])
def test_cli_refuses_bad_sampling_options(argv, message, capsys):
    from megatron_kd_plugin.commands.cache import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--teacher", "t", "--data", "d", "--output", "o", "--seq-length", "8", *argv])
    assert message in capsys.readouterr().err


def _cut(path, size):
    path.write_bytes(path.read_bytes()[:size])


@pytest.mark.parametrize("damage,message", [
    (lambda d: _cut(d / "d.idx", 20), r"d.idx is not a Megatron indexed-dataset index: 20 bytes, shorter than the "
                                      "34-byte header"),
    (lambda d: (d / "d.idx").write_bytes(b"garbage" * 40), r"d.idx is not a Megatron indexed-dataset index: 280 "
                                                           "bytes without the indexed-dataset header"),
    (lambda d: _cut(d / "d.idx", (d / "d.idx").stat().st_size // 2), r"d.idx is not a Megatron indexed-dataset "
                                                                      "index: .* truncated or damaged"),
    (lambda d: _cut(d / "d.bin", 0), r"d.bin is empty")], ids=["idx-20-bytes", "idx-garbage", "idx-half", "bin-empty"])
def test_damaged_indexed_datasets_are_one_line_naming_the_file(teacher_and_data, tmp_path, capfd, damage, message):
    import gc

    from megatron_kd_plugin.cache.sources.token_windows import indexed_dataset_windows

    work = teacher_and_data[0]
    for suffix in (".idx", ".bin"):
        shutil.copy(work / f"data{suffix}", tmp_path / f"d{suffix}")
    damage(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}/{message}"):
        indexed_dataset_windows(str(tmp_path / "d"), S)
    gc.collect()                                                  # megatron's half-built readers would complain here
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_truncated_teacher_checkpoint_is_named(teacher_and_data, tmp_path):
    from megatron_kd_plugin.models.gpt import SPEC_FILE, WEIGHTS_FILE, load_gpt

    work = teacher_and_data[0]
    shutil.copy(work / "teacher" / SPEC_FILE, tmp_path / SPEC_FILE)
    (tmp_path / WEIGHTS_FILE).write_bytes((work / "teacher" / WEIGHTS_FILE).read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{tmp_path / WEIGHTS_FILE} cannot be read .*truncated or damaged"):
        load_gpt(tmp_path, tp_size=1)


def test_a_token_id_outside_the_vocabulary_is_refused_before_the_teacher_runs(teacher_and_data, tmp_path):
    """One line naming the .bin, exit 2, nothing at --output (the id, -1, would index the embedding)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    builder.add_document(np.array([1, 2, -1] + [3] * 40, dtype=np.int32), [43])
    builder.finalize(str(tmp_path / "d.idx"))
    result = subprocess.run(_cache_command(teacher_and_data[0] / "teacher", str(tmp_path / "d"), tmp_path / "out",
                                           "--num-samples", "2"), env=_env(1), capture_output=True, text=True,
                            timeout=scaled(600))
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and errors[-1] == (
        f"error: {tmp_path / 'd.bin'}: the data contain the token id -1, outside the teacher's vocabulary [0, 64): "
        "data tokenized for another vocabulary?"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
