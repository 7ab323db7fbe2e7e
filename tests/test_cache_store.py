"""Writer + reader in one process with a table teacher: values, codecs, windows, validation, refusals, resume."""

import errno
import json
import pathlib
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
import zarr

from megatron_kd_plugin.cache import CacheSpec, TopKCacheReader, row_kind
from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store.records import shard_records
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows, jsonl_windows
from megatron_kd_plugin.cache.writer import write_cache

V, S, K, N = 50, 12, 6, 11


def table_teacher(vocab=V, seed=0):
    """logits of token t = row t of a fixed table: deterministic whatever the batch; returns [s, b, V]."""
    table = 4 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
    return table, (lambda tokens, position_ids=None: table[tokens].transpose(0, 1))


def windows(n=N, seq=S, vocab=V, seed=1, **kwargs):
    stream = np.random.default_rng(seed).integers(0, vocab, n * seq + 1)
    return TokenWindows(stream, seq, num_samples=n, fingerprint="test-data", tokenizer="test-tok",
                        tokenizer_vocab_size=kwargs.pop("tokenizer_vocab_size", vocab), **kwargs)


def write(path, source=None, logits_fn=None, **kwargs):
    source = source or windows()
    logits_fn = logits_fn or table_teacher()[1]
    options = dict(k=K, vocab_size=V, teacher="table", samples_per_shard=4, micro_batch_size=3, progress=False)
    return write_cache(source, logits_fn, path, **(options | kwargs))


def same_sample(a, b) -> bool:
    """Whether two ``reader[i]`` samples hold equal tensors (and the same fields)."""
    def fields(sample):
        return [sample.tokens, *sample.teacher, sample.logsumexp, sample.realised_logprob]
    return type(a.teacher) is type(b.teacher) and all(
        x is y if x is None or y is None else torch.equal(x, y) for x, y in zip(fields(a), fields(b)))


def reference(table, tokens, temperature=1.0):
    """float64 (ids sorted ascending, log-probs in that order) for each row of a window [S+1]."""
    logprobs = torch.log_softmax(table.double()[tokens[:-1]] / temperature, dim=-1)         # [S, V]
    top = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[:, :K]
    ids = top.sort(dim=-1).values
    return ids, logprobs.gather(-1, ids)


# round-to-nearest keeps the relative error of a stored value below 2^-(mantissa bits + 1); bit-rounding
# rounds the fp16 value again
@pytest.mark.parametrize("codec,relative", [("fp32", 0.0), ("fp16", 2.0**-11),
                                            ("fp16-bitround8", 2.0**-9 + 2.0**-11)])
def test_store_holds_the_teachers_topk(tmp_path, codec, relative):
    table, logits_fn = table_teacher()
    source = windows()
    stats = write(tmp_path / "c", source, logits_fn, logprob_codec=codec, temperature=0.8, store_logsumexp=True)
    assert stats.tokens == N * S and stats.shards_written == 3
    reader = TopKCacheReader(tmp_path / "c")
    assert len(reader) == N and reader.spec.k == K and reader.spec.logprob_codec == codec
    for i in range(N):
        sample = reader[i]
        tokens = torch.from_numpy(source.windows(i, i + 1)[0])
        ids, logprobs = reference(table, tokens, 0.8)
        assert torch.equal(sample.tokens, tokens)
        assert torch.equal(sample.teacher.ids, ids)
        assert sample.teacher.ids.dtype == torch.int64 and sample.teacher.logprobs.dtype == torch.float32
        error = (sample.teacher.logprobs.double() - logprobs).abs()
        assert (error <= relative * logprobs.abs() + 1e-5).all()        # 1e-5: float32 arithmetic
        if relative:
            assert (error > 1e-5).any()                                   # the codec really rounds
        lse = torch.logsumexp(table.double()[tokens[:-1]] / 0.8, dim=-1)
        torch.testing.assert_close(sample.logsumexp.double(), lse, atol=1e-5, rtol=0)


def test_fast_chunk_reads_equal_zarr_reads(tmp_path):
    write(tmp_path / "c")
    reader = TopKCacheReader(tmp_path / "c")
    group = zarr.open_group(tmp_path / "c", mode="r")
    for i in range(N):
        fast = reader.sample_arrays(i)
        for name, values in fast.items():
            assert values.dtype == group[name].dtype and np.array_equal(values, group[name][i]), (name, i)


def test_windows_of_a_shorter_student_sequence(tmp_path):
    """A student of seq_length 4 reads S / 4 = 3 windows per sample (``SlotRows``): each the tokens, shifted labels
    and top-K rows of that stretch of the sample, in the store's dtypes."""

    write(tmp_path / "c")
    reader = TopKCacheReader(tmp_path / "c")
    kind = row_kind(reader, seq_length=4)
    assert kind.rows_per_sample() == 3
    for sample, part in ((0, 0), (0, 1), (0, 2), (1, 0), (N - 1, 2)):
        row, full = kind.row(sample, part), reader[sample]
        assert torch.equal(row.tokens, full.tokens[4 * part:4 * part + 4])
        assert torch.equal(row.labels, full.tokens[4 * part + 1:4 * part + 5])
        assert row.teacher.ids.dtype == torch.int32
        assert torch.equal(row.teacher.ids.long(), full.teacher.ids[4 * part:4 * part + 4])
        assert torch.equal(row.teacher.logprobs.float(), full.teacher.logprobs[4 * part:4 * part + 4])
    # a row's tensors are its own: none wraps the reader's read-only decode buffers (an fp16 store's log-probs;
    # torch warned of undefined behaviour in every heal's log)
    write(tmp_path / "fp16", logprob_codec="fp16")
    wrapped, from_numpy = [], torch.from_numpy
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "from_numpy", lambda array: wrapped.append(array.flags.writeable) or from_numpy(array))
        row_kind(TopKCacheReader(tmp_path / "fp16"), seq_length=4).row(0, 1)
    assert wrapped and all(wrapped), wrapped
    with pytest.raises(ValueError, match="does not divide"):
        row_kind(reader, seq_length=5)
    with pytest.raises(IndexError):
        reader[N]


def test_validate_names_what_does_not_fit(tmp_path):
    write(tmp_path / "c")
    reader = TopKCacheReader(tmp_path / "c")
    reader.validate(vocab_size=V, seq_length=6, k=K, fingerprint=reader.spec.fingerprint, tokenizer="test-tok")
    reader.validate(vocab_size=V + 14)           # a student with a larger padded vocabulary is fine
    for bad, message in [(dict(vocab_size=V - 1), "larger than the student"), (dict(seq_length=5), "divide"),
                         (dict(k=K + 1), "k="), (dict(fingerprint="other"), "fingerprint"),
                         (dict(tokenizer="gpt2"), "tokenizer")]:
        with pytest.raises(ValueError, match=message):
            reader.validate(**bad)


def test_reader_refuses_other_formats(tmp_path):
    with pytest.raises(ValueError, match="no zarr.json"):
        TopKCacheReader(tmp_path)
    write(tmp_path / "c")
    group = zarr.open_group(tmp_path / "c", mode="r+")
    group.attrs["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        TopKCacheReader(tmp_path / "c")
    group.attrs["format"] = "something-else"
    with pytest.raises(ValueError, match="not a teacher cache"):
        TopKCacheReader(tmp_path / "c")
    group.attrs.update(format=fmt.SAMPLED_FORMAT_NAME, version=fmt.FORMAT_VERSION)   # format and mode disagree
    with pytest.raises(ValueError, match="not a teacher cache"):
        TopKCacheReader(tmp_path / "c")


def test_non_finite_teacher_logits_name_sample_and_position(tmp_path):
    table, logits_fn = table_teacher()
    source = windows()
    bad_sample, bad_position = 6, 9
    bad_token = int(source.windows(bad_sample, bad_sample + 1)[0, bad_position])

    def poisoned(tokens, position_ids=None):
        logits = logits_fn(tokens).clone()
        logits[tokens.t() == bad_token] = float("nan")  # every occurrence of that token
        return logits

    first = int(np.flatnonzero(source.stream[:N * S] == bad_token)[0])
    sample, position = divmod(first, S)
    with pytest.raises(ValueError, match=f"sample {sample}, position {position}"):
        write(tmp_path / "c", source, poisoned)
    with pytest.raises(ValueError, match="unfinished"):
        TopKCacheReader(tmp_path / "c")


def test_data_that_do_not_fit_the_teacher_vocab_are_refused(tmp_path):
    with pytest.raises(ValueError, match="token id"):
        write(tmp_path / "a", windows(vocab=V + 5, tokenizer_vocab_size=None))
    with pytest.raises(ValueError, match="tokenizer"):
        write(tmp_path / "b", windows(tokenizer_vocab_size=V + 1))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_other_settings_at_the_path_are_refused_unless_overwrite(tmp_path):
    write(tmp_path / "c")
    before = json.loads((tmp_path / "c" / "zarr.json").read_text())
    with pytest.raises(ValueError, match=r"k: requested 5, on disk 6"):
        write(tmp_path / "c", k=5)
    assert json.loads((tmp_path / "c" / "zarr.json").read_text()) == before
    write(tmp_path / "c", k=5, overwrite=True)
    assert TopKCacheReader(tmp_path / "c").spec.k == 5
    again = write(tmp_path / "c", k=5)                       # same settings, complete: nothing to do
    assert again.shards_written == 0 and again.shards_skipped == 3


def test_overwrite_replaces_only_a_store_of_this_tool_and_never_a_users_file(tmp_path):
    folder = tmp_path / "d"                                       # a user's folder with a file in it
    folder.mkdir()
    (folder / "precious.txt").write_text("mine")
    plain = tmp_path / "notes.txt"                                # a regular file
    plain.write_text("mine too")
    write(tmp_path / "c")
    (tmp_path / "c" / fmt.IDS / "readme.txt").write_text("a user's note inside a store")
    for path, named in ((folder, "precious.txt"), (plain, "not a folder"), (tmp_path / "c", "readme.txt")):
        for overwrite in (True, False):
            with pytest.raises(ValueError, match=f"not a cache store written by this tool.*{named}"):
                write(path, k=5, overwrite=overwrite)
    assert (folder / "precious.txt").read_text() == "mine" and plain.read_text() == "mine too"
    assert (tmp_path / "c" / fmt.IDS / "readme.txt").exists() and TopKCacheReader(tmp_path / "c").spec.k == K
    (tmp_path / "c" / fmt.IDS / "readme.txt").unlink()
    write(tmp_path / "c", k=5, overwrite=True)                    # a store of this tool is replaced
    (tmp_path / "empty").mkdir()                                  # an empty folder is used
    write(tmp_path / "empty")
    assert TopKCacheReader(tmp_path / "c").spec.k == 5 and TopKCacheReader(tmp_path / "empty").spec.k == K


def _shard_index(path):
    """(index [P, 2] uint64 (offset, nbytes) per chunk, index start) of a one-dimensional-chunked shard file."""
    data = path.read_bytes()
    start = len(data) - 16 * 4 - 4                                 # 4 samples per shard, then the CRC32C
    return np.frombuffer(data[start:start + 64], dtype="<u8").reshape(4, 2).copy(), start


def _repoint(store):
    """Shard 0 of teacher_ids: chunk 1's index entry pointed at chunk 2's bytes, the index CRC left as it was."""
    shard = store / fmt.IDS / "c.0.0.0"
    index, start = _shard_index(shard)
    index[1] = index[2]
    data = bytearray(shard.read_bytes())
    data[start:start + 64] = index.tobytes()
    shard.write_bytes(bytes(data))


def _flip(store):
    """One bit flipped in the middle of sample 1's token chunk."""
    shard = store / fmt.TOKENS / "c.0.0"
    offset, nbytes = _shard_index(shard)[0][1]
    data = bytearray(shard.read_bytes())
    data[int(offset + nbytes // 2)] ^= 0x10
    shard.write_bytes(bytes(data))


def _delete(store):
    """The shard file of samples 4-7 of teacher_logprobs deleted."""
    (store / fmt.LOGPROBS / "c.1.0.0").unlink()


@pytest.mark.parametrize("damage,sample,array,message", [
    (_repoint, 1, fmt.IDS, "shard index.*CRC32C"),
    (_flip, 1, fmt.TOKENS, r"chunk \(1, 0\).*CRC32C"),
    (_delete, 5, fmt.LOGPROBS, "missing")], ids=["repointed-index", "flipped-bit", "deleted-shard"])
def test_damaged_stores_raise_instead_of_reading_back_wrong_data(tmp_path, capsys, damage, sample, array, message):
    """Each damage the issue found reading back silently raises in the reader and in ``inspect --verify``; plain
    zarr raises on the checksums and fills a missing shard with values no store holds; the rest still reads."""
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "c")
    untouched = next(i for i in range(N) if i // 4 != sample // 4)
    expected = TopKCacheReader(tmp_path / "c")[untouched]
    damage(tmp_path / "c")
    reader = TopKCacheReader(tmp_path / "c")
    with pytest.raises(ValueError, match=message):
        reader[sample]
    with pytest.raises(ValueError, match=message):
        row_kind(reader, seq_length=S // 2).row(sample, 1)
    assert inspect_main([str(tmp_path / "c"), "--verify"]) == 2 and re.search(message, capsys.readouterr().out)
    group = zarr.open_group(tmp_path / "c", mode="r")
    if damage is _delete:                                         # -1 ids, NaN log-probs: never plausible data
        assert np.isnan(group[array][sample]).all()
    else:
        with pytest.raises(ValueError, match="checksum"):
            group[array][sample]
    assert same_sample(reader[untouched], expected)


def test_inspect_verify_passes_on_an_intact_store(tmp_path, capsys):
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "c")
    assert inspect_main([str(tmp_path / "c"), "--verify"]) == 0
    assert f"every checksum and record of the {N} written samples matches" in capsys.readouterr().out


@pytest.mark.parametrize("field,factor", [("k", 0.5), ("seq_length", 0.5), ("num_samples", 2),
                                          ("samples_per_shard", 2)])
def test_attributes_edited_against_the_arrays_are_refused(tmp_path, field, factor):
    """Even with the attributes' checksum recomputed (a deliberate edit), the arrays' metadata give it away."""
    write(tmp_path / "c")
    edited = int(zarr.open_group(tmp_path / "c", mode="r").attrs[field] * factor)
    _edit_attributes(tmp_path / "c", **{field: edited})
    with pytest.raises(ValueError, match=f"attributes \\(.*{field}={edited}.*\\) do not match the array"):
        TopKCacheReader(tmp_path / "c")


def _edit_attributes(store, recompute=True, **changes):
    """The group attributes edited, their ``identity`` checksum recomputed (``recompute``) as a deliberate edit
    would."""
    group = zarr.open_group(store, mode="r+")
    attrs = dict(group.attrs) | changes
    if recompute:
        attrs["identity"] = fmt.store_identity(CacheSpec.from_attrs(attrs))
    group.attrs.put(attrs)


def test_damaged_metadata_give_a_clear_error(tmp_path, capsys):
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "c")
    for file in (tmp_path / "c" / "zarr.json", tmp_path / "c" / fmt.LOGPROBS / "zarr.json"):
        original = file.read_bytes()
        file.write_bytes(original[:len(original) // 2])           # truncated
        with pytest.raises(ValueError, match=f"{file} is damaged \\(not valid JSON"):
            TopKCacheReader(tmp_path / "c")
        assert inspect_main([str(tmp_path / "c")]) == 2 and f"{file} is damaged" in capsys.readouterr().out
        file.write_bytes(original)
    TopKCacheReader(tmp_path / "c")


def test_version_1_stores_are_refused_with_a_rewrite_hint(tmp_path):
    write(tmp_path / "c")
    zarr.open_group(tmp_path / "c", mode="r+").attrs["version"] = 1
    with pytest.raises(ValueError, match="version 1 .*no chunk checksums.*--overwrite"):
        TopKCacheReader(tmp_path / "c")
    write(tmp_path / "c", overwrite=True)                         # rewritten in the current version
    assert TopKCacheReader(tmp_path / "c").group.attrs["version"] == fmt.FORMAT_VERSION


def test_a_second_writer_is_refused_while_a_process_of_the_first_holds_the_lock(tmp_path):
    import subprocess
    import sys

    write(tmp_path / "c")
    (tmp_path / "c" / fmt.RECORDS / "c.1.0").unlink()            # unfinished: a resume would write
    lock = tmp_path / "c" / ".writer.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
                               str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = _tree(tmp_path / "c")
        for overwrite in (False, True):
            with pytest.raises(ValueError, match=f"another run is writing {tmp_path / 'c'}"):
                write(tmp_path / "c", overwrite=overwrite)
        assert _tree(tmp_path / "c") == before
    finally:
        holder.kill()
        holder.wait()
    assert write(tmp_path / "c").shards_written == 1              # the holder gone, the run resumes


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _teacher_that_must_not_load(path, tp_size):
    raise AssertionError("the cache command loaded the teacher although another run holds the store's lock")


def test_the_cache_command_refuses_a_locked_store_before_loading_the_teacher(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):   # the command sets them for its single
        monkeypatch.setenv(key, "")                                    # process: restored (or removed) after
        monkeypatch.delenv(key)

    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_kd_plugin.commands.cache import main

    tokenizer = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a b " * 40}) + "\n")
    write(tmp_path / "c")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
                               str(tmp_path / "c" / ".writer.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code = main(["--teacher", "unused", "--teacher-loader", f"{__name__}:_teacher_that_must_not_load",
                     "--vocab-size", "3", "--data", str(tmp_path / "docs.jsonl"), "--tokenizer",
                     str(tmp_path / "tokenizer.json"), "--output", str(tmp_path / "c"), "--seq-length", "8",
                     "--topk", "2", "--no-progress"])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and f"another run is writing {tmp_path / 'c'}" in capsys.readouterr().err


def test_resume_redoes_unmarked_shards_bit_identically(tmp_path):
    write(tmp_path / "full")
    write(tmp_path / "part")
    group = zarr.open_group(tmp_path / "part", mode="r+")
    (tmp_path / "part" / fmt.RECORDS / "c.1.0").unlink()        # as if killed before the records of shard 1
    group[fmt.IDS][4:8] = 0                                       # ... with its data half written
    group.attrs.update(complete=False)
    for partial in (f"{fmt.IDS}/c.1.0", "zarr", f"{fmt.RECORDS}/c.1"):   # and between write and rename
        (tmp_path / "part" / f"{partial}.{'0123456789abcdef' * 2}.partial").write_bytes(b"half a chunk")
    with pytest.raises(ValueError, match=r"samples \[4, 8\) of 11 are not written"):
        TopKCacheReader(tmp_path / "part")
    stats = write(tmp_path / "part")
    assert (stats.shards_written, stats.shards_skipped) == (1, 2)
    assert _tree(tmp_path / "part") == _tree(tmp_path / "full")


def test_full_disk_leaves_an_incomplete_store_and_says_so(tmp_path, monkeypatch):
    import megatron_kd_plugin.cache.writer as writer

    real, calls = writer.store_shard, []

    def disk_fills_during_second_shard(group, spec, shard, arrays, output=None):
        calls.append(shard)
        if len(calls) == 2:
            group[fmt.TOKENS][4:8] = arrays[fmt.TOKENS]          # some data went out, then the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")
        real(group, spec, shard, arrays, output)

    monkeypatch.setattr(writer, "store_shard", disk_fills_during_second_shard)
    with pytest.raises(OSError, match="disk full while writing shard 1"):
        write(tmp_path / "c")
    with pytest.raises(ValueError, match=r"samples \[4, 11\) of 11 are not written"):
        TopKCacheReader(tmp_path / "c")


def test_a_store_that_cannot_be_created_names_the_output_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a regular file")
    output = tmp_path / "file" / "c.zarr"                         # under a path that cannot be a folder
    with pytest.raises(OSError, match=f"cannot create the store {output}: .*check that {output.parent} is a folder") \
            as raised:
        write(output)
    assert ".creating" not in str(raised.value)
    real = fmt._create_arrays

    def disk_fills(group, spec):
        real(group, spec)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "_create_arrays", disk_fills)
    with pytest.raises(OSError, match=f"cannot create the store {tmp_path / 'c'}: No space left on device; free "
                                      "space .* and rerun the same command"):
        write(tmp_path / "c")
    assert sorted(tmp_path.iterdir()) == [tmp_path / "file"]      # no store, no staging folder left


def test_jsonl_source_with_a_tokenizers_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [f"the cat {i} sat on the mat number {i % 7}" for i in range(40)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source = jsonl_windows(str(tmp_path / "docs.jsonl"), str(tmp_path / "tokenizer.json"), 8)
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [i for t in texts for i in tokenizer.encode(t).ids + [eos]]
    assert len(source) == (len(expected) - 1) // 8
    assert source.windows(2, 3)[0].tolist() == expected[16:25]
    vocab = tokenizer.get_vocab_size()
    write(tmp_path / "c", source, table_teacher(vocab)[1], vocab_size=vocab, k=4)
    reader = TopKCacheReader(tmp_path / "c")
    assert reader.spec.tokenizer.startswith("tokenizer.json:sha256=")
    assert reader[2].tokens.tolist() == expected[16:25]
    with pytest.raises(ValueError, match="tokenizer"):
        write(tmp_path / "d", source, table_teacher(vocab - 1)[1], vocab_size=vocab - 1, k=4)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": texts[0]}) + "\n" + json.dumps({"text": 123}) + "\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 'bad.jsonl'}:2: 'text' holds int 123, expected a string"):
        jsonl_windows(str(tmp_path / "bad.jsonl"), str(tmp_path / "tokenizer.json"), 8)


def test_spec_rejects_bad_values():
    good = dict(k=4, vocab_size=10, seq_length=8, num_samples=3)
    CacheSpec(**good)
    for bad, match in [(dict(k=0), "k"), (dict(k=11), "k"), (dict(vocab_size=2**31 + 1), "vocab"),
                       (dict(temperature=0.0), "temperature"), (dict(logprob_codec="bf16"), "logprob"),
                       (dict(samples_per_shard=0), "samples"), (dict(mode="random"), "mode"),
                       (dict(proposal_temperature=1.5), "applies to a sampled store only"),
                           (dict(sample_seed=3), "applies to a sampled store only"),
                       (dict(mode="sampled", proposal_temperature=0.0), "proposal_temperature must be > 0"),
                       (dict(mode="sampled", sample_seed=-1), "sample_seed must be >= 0")]:
        with pytest.raises(ValueError, match=match):
            CacheSpec(**(good | bad))
    CacheSpec(**(good | dict(mode="sampled", k=40)))                  # N draws may exceed V (with replacement)


def test_inspect_reports_completeness_sizes_and_distributions(tmp_path, capsys):
    from megatron_kd_plugin.cache.kinds.top_k_store import topk_statistics
    from megatron_kd_plugin.commands.inspect import main

    write(tmp_path / "c")
    assert main([str(tmp_path / "c"), "--plot", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "complete: yes (11 samples)" in out and "teacher_ids" in out and "bytes/token" in out
    assert "top-K mass" in out and "entropy" in out and (tmp_path / "h.png").stat().st_size > 0
    mass, entropy = topk_statistics(np.log(np.array([[0.5, 0.25, 0.25], [0.5, 0.25, 0.125]])))
    np.testing.assert_allclose(mass, [1.0, 0.875])
    np.testing.assert_allclose(entropy, [1.5 * np.log(2), 1.375 * np.log(2) - 0.125 * np.log(0.125)])
    (tmp_path / "c" / fmt.RECORDS / "c.2.0").unlink()
    zarr.open_group(tmp_path / "c", mode="r+").attrs.update(complete=False)
    assert main([str(tmp_path / "c")]) == 0
    assert "complete: NO — samples [8, 11) not written" in capsys.readouterr().out


def loader_for_test(path, tp_size):
    """A --teacher-loader target: returns what it was called with."""
    return ("model", str(path), tp_size)


def test_cli_teacher_loader_hook_and_its_vocab_requirement(tmp_path):
    import argparse

    from megatron_kd_plugin.commands.cache import load_teacher

    args = argparse.Namespace(teacher=str(tmp_path), teacher_loader="tests.test_cache_store:loader_for_test",
                              vocab_size=77, tp=2, seq_length=8)
    model, vocab, identity = load_teacher(args)
    assert model == ("model", str(tmp_path), 2) and vocab == 77 and identity.startswith(f"{tmp_path.name}:sha256=")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        load_teacher(argparse.Namespace(**(vars(args) | dict(vocab_size=None))))


@pytest.mark.parametrize("t", [1.0, 1.5])
def test_sampled_store_holds_the_draws_and_the_reader_their_weights(tmp_path, t):
    from megatron_kd_plugin.cache.kinds.draws import draw_uniforms, draw_weights, vocab_parallel_draws

    table, logits_fn = table_teacher()
    source, n = windows(), 9
    write(tmp_path / "c", source, logits_fn, k=n, mode="sampled", proposal_temperature=t, sample_seed=4,
          temperature=0.8, logprob_codec="fp32")
    group = zarr.open_group(tmp_path / "c", mode="r")
    assert group.attrs["format"] == fmt.SAMPLED_FORMAT_NAME and group.attrs["mode"] == "sampled"
    assert (fmt.PROPOSAL_LOGNORM in group) == (t != 1.0)
    reader = TopKCacheReader(tmp_path / "c")
    for i in range(N):
        tokens = torch.from_numpy(source.windows(i, i + 1)[0])
        logits = table[tokens[:-1]].unsqueeze(1)                                          # [S, 1, V]
        draw = vocab_parallel_draws(logits, draw_uniforms(4, i, 1, S, n), temperature=0.8,
                                     proposal_temperature=t)
        row = reader[i]
        assert torch.equal(row.teacher.ids, draw.ids[:, 0])
        l = torch.log_softmax(table.double()[tokens[:-1]] / 0.8, dim=-1)                  # [S, V]
        torch.testing.assert_close(row.teacher.logprobs.double(), l.gather(-1, row.teacher.ids), atol=1e-5,
                                   rtol=0)
        expected = draw_weights(l.gather(-1, row.teacher.ids), torch.logsumexp(l / t, dim=-1), t)
        torch.testing.assert_close(row.teacher.weights, expected.float(), atol=0, rtol=1e-5)
        assert row.teacher.weights.shape == (S, n) and row.teacher.weights.dtype == torch.float32
    half = row_kind(reader, seq_length=S // 2).row(3, 1).teacher                    # a student's rows: the same
    assert torch.equal(half.weights, reader[3].teacher.weights[S // 2:])            # weights, of its window
    with pytest.raises(ValueError, match="mode='topk' requested"):
        reader.validate(mode="topk")


def test_draws_of_a_confident_teacher_keep_their_mass_and_a_grid_codec_is_refused_for_them(tmp_path, capsys):
    """64 draws per token from a confident teacher: with the sampled store's default codec the distinct drawn mass
    stays <= 1 (the loss's input check passes); the grid codec, whose mass balance is a top-K row's, decoded it up
    to 1.07 here (the loss refused the rows) and is refused for draws by the writer and the cache command."""
    from megatron_kd_plugin.commands.cache import main

    table = 6 * torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    write(tmp_path / "d", logits_fn=lambda tokens, position_ids=None: table[tokens].transpose(0, 1), k=64, mode="sampled")
    reader = TopKCacheReader(tmp_path / "d")
    assert reader.spec.logprob_codec == fmt.DEFAULT_DRAWS_CODEC
    kind = row_kind(reader, seq_length=S)
    mass = max(float(kind.row(i, 0).teacher.mass().max()) for i in range(N))
    assert 0.99 < mass <= 1.0 + 1e-3, mass
    with pytest.raises(ValueError, match="log-prob codec 'grid8' with draws: its mass balance is a top-K row's"):
        write(tmp_path / "g", k=64, mode="sampled", logprob_codec="grid8")
    assert main(["--teacher", "t", "--data", "d", "--output", str(tmp_path / "o"), "--seq-length", "8",
                 "--draws", "8", "--logprob-codec", "grid8"]) == 2
    assert "log-prob codec 'grid8' with draws" in capsys.readouterr().err


def test_sampled_store_resumes_bit_identically_whatever_the_micro_batch_and_dp_split(tmp_path):
    options = dict(k=12, mode="sampled", proposal_temperature=1.5, sample_seed=1)
    write(tmp_path / "full", **options)
    write(tmp_path / "other_batches", **options, micro_batch_size=1)       # draws depend on the sample only
    with pytest.raises(ValueError, match="cannot finish"):                 # DP rank 0 of 2 writes its shards ...
        write(tmp_path / "dp2", **options, dp_rank=0, dp_size=2)
    write(tmp_path / "dp2", **options, dp_rank=1, dp_size=2)               # ... DP rank 1 the rest, then finishes
    write(tmp_path / "part", **options)
    group = zarr.open_group(tmp_path / "part", mode="r+")
    (tmp_path / "part" / fmt.RECORDS / "c.1.0").unlink()
    group[fmt.IDS][4:8] = 0
    group.attrs.update(complete=False)
    stats = write(tmp_path / "part", **options)
    assert (stats.shards_written, stats.shards_skipped) == (1, 2)
    assert _tree(tmp_path / "part") == _tree(tmp_path / "full") == _tree(tmp_path / "other_batches") == \
        _tree(tmp_path / "dp2")
    with pytest.raises(ValueError, match="sample_seed: requested 2, on disk 1"):
        write(tmp_path / "part", **(options | dict(sample_seed=2)))


def test_stores_written_before_the_sampled_mode_stay_readable(tmp_path):
    write(tmp_path / "c")
    group = zarr.open_group(tmp_path / "c", mode="r+")
    attrs = dict(group.attrs)
    for key in ("mode", "proposal_temperature", "sample_seed"):
        del attrs[key]
    group.attrs.put(attrs)
    reader = TopKCacheReader(tmp_path / "c")
    assert reader.spec.mode == "topk" and reader[0].teacher.weights is None


def _swap(first, second):
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


@pytest.mark.parametrize("array", [fmt.TOKENS, fmt.IDS, fmt.LOGPROBS])
def test_swapped_shard_files_raise_and_verify_names_both(tmp_path, capsys, array):
    """Issue 20 item 1: swapped shard files keep valid chunk checksums; their records give them away."""
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "c")
    suffix = ".0" * (1 if array == fmt.TOKENS else 2)
    _swap(tmp_path / "c" / array / f"c.0{suffix}", tmp_path / "c" / array / f"c.1{suffix}")
    reader = TopKCacheReader(tmp_path / "c")
    for sample in (0, 5):
        with pytest.raises(ValueError, match=f"{array}/c.{sample // 4}\\..*samples \\[{sample // 4 * 4}, "
                                             f"{sample // 4 * 4 + 4}\\)\\): the chunk of sample {sample} was not "
                                             "written there.*--repair"):
            reader[sample]
    reader[9]                                                     # shard 2 untouched
    assert inspect_main([str(tmp_path / "c"), "--verify"]) == 2
    out = capsys.readouterr().out
    assert "2 of 3 written shards" in out and "shard 0 (samples [0, 4))" in out and "shard 1 (samples [4, 8))" in out
    assert inspect_main([str(tmp_path / "c"), "--samples", str(N)]) == 2   # the statistics' reads see it too
    assert "was not written there" in capsys.readouterr().out


def test_a_chunk_moved_inside_its_shard_with_the_index_checksum_recomputed_raises(tmp_path):
    """What CRC32Cs alone cannot see (a deliberate index edit): the record of the place still differs."""
    import google_crc32c

    write(tmp_path / "c")
    shard = tmp_path / "c" / fmt.IDS / "c.0.0.0"
    index, start = _shard_index(shard)
    index[1] = index[2]
    data = bytearray(shard.read_bytes())
    data[start:start + 64] = index.tobytes()
    data[start + 64:start + 68] = google_crc32c.value(bytes(data[start:start + 64])).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="the chunk of sample 1 was not written there"):
        TopKCacheReader(tmp_path / "c")[1]


def test_a_shard_copied_from_a_store_of_another_teacher_raises(tmp_path):
    write(tmp_path / "c")
    write(tmp_path / "other", logits_fn=table_teacher(seed=5)[1], teacher="another teacher")   # same shapes
    file = pathlib.Path(fmt.LOGPROBS, "c.1.0.0")
    (tmp_path / "c" / file).write_bytes((tmp_path / "other" / file).read_bytes())
    with pytest.raises(ValueError, match="teacher_logprobs/c.1.0.0 .*sample 4 was not written there"):
        TopKCacheReader(tmp_path / "c")[4]


@pytest.mark.parametrize("array,edit,path", [
    (fmt.IDS, lambda d: d["codecs"][0]["configuration"]["codecs"][1]["configuration"].update(endian="big"),
     "codecs[0].configuration.codecs[1].configuration.endian 'big' on disk, 'little' implied"),
    (fmt.TOKENS, lambda d: d["codecs"][0]["configuration"]["codecs"][0]["configuration"].update(endian="big"),
     "codecs[0].configuration.codecs[0].configuration.endian 'big' on disk, 'little' implied"),
    (fmt.IDS, lambda d: d["codecs"][0]["configuration"]["codecs"][0]["configuration"].update(dtype="<i2"),
     "codecs[0].configuration.codecs[0].configuration.dtype '<i2' on disk, '<i4' implied"),
    (fmt.LOGPROBS, lambda d: d.update(fill_value=0.0), "fill_value 0.0 on disk, 'NaN' implied")])
def test_codec_settings_edited_in_an_arrays_zarr_json_are_refused(tmp_path, capsys, array, edit, path):
    """Issue 20 item 2: every setting of every array's zarr.json is compared, not just the codec names."""
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "c")
    file = tmp_path / "c" / array / "zarr.json"
    document = json.loads(file.read_text())
    edit(document)
    file.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=re.escape(f"{file}: the attributes (") + ".*" + re.escape(path)):
        TopKCacheReader(tmp_path / "c")
    assert inspect_main([str(tmp_path / "c"), "--verify"]) == 2 and path in capsys.readouterr().out


@pytest.mark.parametrize("field,value", [("vocab_size", 48), ("temperature", 2.0), ("fingerprint", "other data"),
                                         ("logprob_codec", "fp16"), ("teacher", "another")])
def test_edited_attributes_fail_their_checksum_and_recomputing_it_fails_every_record(tmp_path, field, value):
    """Issue 20 item 3: an edited attribute is refused on open; with the checksum recomputed too, every chunk's
    record (bound to the old identity) refuses the rows."""
    write(tmp_path / "c")
    original = json.loads((tmp_path / "c" / "zarr.json").read_text())
    _edit_attributes(tmp_path / "c", recompute=False, **{field: value})
    with pytest.raises(ValueError, match="the attributes that decide how rows are read and trained on do not match "
                                         "their checksum"):
        TopKCacheReader(tmp_path / "c")
    (tmp_path / "c" / "zarr.json").write_text(json.dumps(original))
    _edit_attributes(tmp_path / "c", **{field: value})
    if field == "logprob_codec":                # the arrays' metadata differ first (grid8 also shuffles ids by byte)
        with pytest.raises(ValueError, match="do not match the array teacher_(ids|logprobs)"):
            TopKCacheReader(tmp_path / "c")
        return
    reader = TopKCacheReader(tmp_path / "c")
    for sample in range(N):
        with pytest.raises(ValueError, match=f"the chunk of sample {sample} was not written there"):
            reader[sample]


def test_ids_outside_the_vocabulary_raise_even_with_every_checksum_and_record_recomputed(tmp_path):
    from megatron_kd_plugin.cache.store.records import shard_records

    write(tmp_path / "c")
    ids = zarr.open_group(tmp_path / "c", mode="r")[fmt.IDS][:]
    _edit_attributes(tmp_path / "c", vocab_size=int(ids[..., -1].max()))          # the largest id no longer fits
    group = zarr.open_group(tmp_path / "c", mode="r+")
    spec = CacheSpec.from_attrs(dict(group.attrs))
    for shard in range(spec.num_shards):
        group[fmt.RECORDS][slice(*spec.shard_range(shard))] = shard_records(tmp_path / "c", group, spec, shard)
    reader = TopKCacheReader(tmp_path / "c")
    bad = int(np.flatnonzero((ids[..., -1] >= spec.vocab_size).any(-1))[0])
    with pytest.raises(ValueError, match=f"sample {bad} holds the id {spec.vocab_size}, outside the teacher "
                                         f"vocabulary \\[0, {spec.vocab_size}\\)"):
        reader[bad]


def test_a_reader_opened_before_the_store_was_replaced_says_so(tmp_path):
    """Issue 20 item 4: cached shard indexes and all, the old reader serves nothing of the new store."""
    write(tmp_path / "c")
    reader = TopKCacheReader(tmp_path / "c")
    for sample in range(N):
        reader[sample]                                            # every shard index cached
    write(tmp_path / "c", k=5, overwrite=True)
    for sample in range(N):
        with pytest.raises(ValueError, match=f"{tmp_path / 'c'} was replaced .* since this reader opened it"):
            reader[sample]
    assert TopKCacheReader(tmp_path / "c")[0].teacher.ids.shape == (S, 5)


@pytest.mark.parametrize("layout", ["chunk-only", "bad-zarr-json"])
def test_overwrite_never_deletes_a_folder_that_merely_looks_like_a_store(tmp_path, layout):
    """Issue 20 item 5: "written by this tool" is decided by the store's own format attribute."""
    user = tmp_path / "u"
    (user / fmt.TOKENS / "c" / "0").mkdir(parents=True)
    (user / fmt.TOKENS / "c" / "0" / "0").write_text("mine")
    if layout == "bad-zarr-json":
        (user / "zarr.json").write_text("my notes, not JSON")
        (user / fmt.TOKENS / "zarr.json").write_text("{}")
    before = _tree(user)
    for overwrite in (True, False):
        with pytest.raises(ValueError, match="not a cache store written by this tool"):
            write(user, overwrite=overwrite)
    assert _tree(user) == before


def _damage_three_shards(store):
    _flip(store)                                                  # tokens, shard 0
    _delete(store)                                                # teacher_logprobs, shard 1
    records = store / fmt.RECORDS / "c.2.0"
    records.write_bytes(records.read_bytes()[:-1])                # chunk_records, shard 2: truncated


def test_repair_rewrites_only_the_damaged_shards_byte_identical_to_a_clean_run(tmp_path, capsys):
    """Issue 20 items 6 and 7: every command names the damage and --repair; the repair makes the clean store."""
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "clean")
    write(tmp_path / "c")
    _damage_three_shards(tmp_path / "c")
    assert inspect_main([str(tmp_path / "c")]) == 2               # no --verify: the missing file is found
    out = capsys.readouterr().out
    assert "teacher_logprobs/c.1.0.0 (samples [4, 8))" in out and "--repair" in out
    with pytest.raises(ValueError, match="files of written shards are missing.*--repair"):
        write(tmp_path / "c")                                     # the plain resume does not say "nothing to do"
    assert inspect_main([str(tmp_path / "c"), "--verify"]) == 2
    out = capsys.readouterr().out
    assert "3 of 3 written shards" in out and all(f"shard {j} (samples" in out for j in range(3))
    stats = write(tmp_path / "c", repair=True)
    assert (stats.shards_written, stats.shards_skipped) == (3, 0)
    assert _tree(tmp_path / "c") == _tree(tmp_path / "clean")
    stats = write(tmp_path / "c", repair=True)                    # nothing damaged: nothing rewritten
    assert (stats.shards_written, stats.shards_skipped) == (0, 3) and "0 of 3 written shards" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match="--repair rewrites the damaged shards of a store written with the same"):
        write(tmp_path / "c", k=5, repair=True)


def rewrite_in_version(store, version: int) -> None:
    """The store at ``store`` rewritten as the writers of format ``version`` (2 to 4) wrote it: "/" chunk keys,
    every shard marked in ``shard_done``, and (3, 4) the records binding each chunk."""
    group, spec = fmt.open_store(store)
    data = {name: group[name][:] for name in fmt.sample_arrays(spec) if name != fmt.RECORDS}
    shutil.rmtree(store)
    old = zarr.open_group(store, mode="w", zarr_format=3)
    fmt._create_arrays(old, spec, version)
    for name, values in data.items():
        old[name][:] = values
    if version >= 3:
        for shard in range(spec.num_shards):
            begin, end = spec.shard_range(shard)
            old[fmt.RECORDS][begin:end] = shard_records(store, old, spec, shard)
    old[fmt.SHARD_DONE][:] = 1
    old.attrs.update(complete=True)


@pytest.mark.parametrize("version,options", [(2, {}), (3, {}), (4, dict(top_p=0.9, min_k=2))])
def test_older_versions_read_and_are_rewritten_only_with_overwrite(tmp_path, version, options):
    """Issue 37: stores of the layouts before version 5 ("/" keys, a shard_done array) keep reading, row for row
    (version 4: the top-p stores)."""
    options = dict(logprob_codec="fp16-bitround7") | options      # version 2 stores predate the grid codec
    write(tmp_path / "c", **options)
    expected = [TopKCacheReader(tmp_path / "c")[i] for i in range(N)]
    rewrite_in_version(tmp_path / "c", version)
    assert (tmp_path / "c" / fmt.IDS / "c" / "1" / "0" / "0").is_file() and (tmp_path / "c" / fmt.SHARD_DONE).is_dir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = TopKCacheReader(tmp_path / "c")
    assert [str(w.message) for w in caught if "format version 2: its chunks are not bound" in str(w.message)
            and "plus --overwrite" in str(w.message)] != [] if version == 2 else caught == []
    assert all(same_sample(reader[i], expected[i]) for i in range(N))
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    assert inspect_main([str(tmp_path / "c"), "--verify", "--workers", "1"]) == 0
    with pytest.raises(ValueError, match=f"version: requested {fmt.FORMAT_VERSION}, on disk {version}"):
        write(tmp_path / "c", **options)
    write(tmp_path / "c", overwrite=True, **options)
    assert TopKCacheReader(tmp_path / "c").group.attrs["version"] == fmt.FORMAT_VERSION


def test_an_existing_empty_folder_is_written_into_not_replaced(tmp_path, monkeypatch):
    """Issue 20 item 9: a mount point cannot be removed or renamed onto (EBUSY); the folder itself is kept."""
    import os

    mount = tmp_path / "mnt"
    mount.mkdir()
    real_rename, real_rmdir = os.rename, os.rmdir

    def busy(path, *args, **kwargs):
        if pathlib.Path(path) == mount or (args and pathlib.Path(args[0]) == mount):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return (real_rename if args else real_rmdir)(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", busy)
    monkeypatch.setattr(os, "rmdir", busy)
    write(mount)
    write(mount, k=5, overwrite=True)                             # replacing keeps the folder too
    assert TopKCacheReader(mount).spec.k == 5 and not (mount / fmt.CREATING).exists()
    for entry in mount.iterdir():                                 # a creation inside it killed half way
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    (mount / fmt.CREATING / fmt.IDS).mkdir(parents=True)
    (mount / fmt.TOKENS).mkdir()
    write(mount)
    assert TopKCacheReader(mount).spec.k == K


def test_bad_tokenizer_and_jsonl_encodings_name_the_file_and_line(tmp_path):
    from megatron_kd_plugin.cache.sources.source_files import load_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(ValueError, match=f"tokenizer {tmp_path / 'tokenizer.json'} is not a valid tokenizer.json"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tmp_path / "tok.json"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"{tmp_path / 'latin1.jsonl'}:2: not UTF-8 \\(byte 0xe9 at column 14\\)"):
        jsonl_windows(str(tmp_path / "latin1.jsonl"), str(tmp_path / "tok.json"), 4)
    (tmp_path / "utf16.jsonl").write_bytes('{"text": "a a a a a"}\n'.encode("utf-16"))
    with pytest.raises(ValueError, match=f"{tmp_path / 'utf16.jsonl'} is UTF-16 encoded"):
        jsonl_windows(str(tmp_path / "utf16.jsonl"), str(tmp_path / "tok.json"), 4)


def test_negative_token_ids_are_refused_before_any_work(tmp_path):
    source = windows()
    source.stream = source.stream.copy()
    source.stream[30] = -3
    with pytest.raises(ValueError, match="the token data: the data contain the token id -3, outside the teacher's "
                                         f"vocabulary \\[0, {V}\\)"):
        write(tmp_path / "c", source)
    assert not (tmp_path / "c").exists()
