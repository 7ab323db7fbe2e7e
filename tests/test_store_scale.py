"""Issue 37: a store's bookkeeping does not grow with the store. Few files (one per array and shard, no folders
below an array's), each data-parallel group checking and repairing its own shards only, a writer whose per-shard
work touches no other shard, bounded reader caches, and --verify over several
processes (the source scanned once on rank 0: ``test_bridge_student``). (The sizes themselves are measured by ``tools/bench_store_scale.py``.)"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import zarr

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store.chunk_reader import ENTRY_BYTES, BoundedCache
from megatron_kd_plugin.cache.store.records import SampleReader, verify_shards
from megatron_kd_plugin.cache.writer import prepare_shards
from tests.test_cache_store import N, S, V, _flip, _tree, write


def test_a_store_holds_one_file_per_array_and_shard_and_no_folders_below_its_arrays(tmp_path):
    write(tmp_path / "c", samples_per_shard=2, store_logsumexp=True)          # 11 samples: 6 shards
    group, spec = fmt.open_store(tmp_path / "c")
    arrays = fmt.sample_arrays(spec)
    assert fmt.SHARD_DONE not in group and fmt.RECORDS in arrays and spec.num_shards == 6
    for name in arrays:
        entries = sorted(entry.name for entry in (tmp_path / "c" / name).iterdir())
        assert entries == sorted([f"c.{shard}" + ".0" * (group[name].ndim - 1) for shard in range(6)] +
                                 ["zarr.json"]), entries
    files = [entry for entry in (tmp_path / "c").rglob("*") if entry.is_file()]
    folders = [entry for entry in (tmp_path / "c").rglob("*") if entry.is_dir()]
    assert len(files) == len(arrays) * spec.num_shards + len(arrays) + 2     # + each zarr.json, root's, lock
    assert sorted(folder.name for folder in folders) == sorted(arrays)
    assert fmt.CacheSpec(k=4, vocab_size=V, seq_length=4096, num_samples=10).samples_per_shard == 256
    assert fmt.CacheSpec(k=4, vocab_size=V, seq_length=1 << 21, num_samples=10).samples_per_shard == 1


def test_each_data_parallel_group_checks_and_repairs_its_own_shards_only(tmp_path, capsys):
    write(tmp_path / "clean")
    write(tmp_path / "c")                                                     # 3 shards of 4 samples
    group, spec = fmt.open_store(tmp_path / "c")
    _flip(tmp_path / "c")                                                     # shard 0: a flipped bit
    (tmp_path / "c" / fmt.LOGPROBS / "c.2.0.0").unlink()                      # shard 2: a file missing
    prepare_shards(tmp_path / "c", spec, range(1, 2), repair=False)          # shard 1's owner: nothing wrong
    with pytest.raises(ValueError, match=r"teacher_logprobs/c\.2\.0\.0 \(samples \[8, 11\)\).*--repair"):
        prepare_shards(tmp_path / "c", spec, range(2, 3), repair=False)
    prepare_shards(tmp_path / "c", spec, range(0, 2), repair=True)           # shards 0-1: 0 is deleted, 2 is not
    assert "1 of 2 written shards of samples [0, 8) damaged" in capsys.readouterr().out
    files = fmt.ShardFiles(tmp_path / "c", group, spec)
    assert files.written() == [1, 2] and files.missing_files(range(2, 3))
    prepare_shards(tmp_path / "c", spec, range(2, 3), repair=True)
    assert files.written() == [1]
    assert write(tmp_path / "c").shards_written == 2
    assert _tree(tmp_path / "c") == _tree(tmp_path / "clean")


def test_the_writer_looks_at_no_shard_but_its_own(tmp_path, monkeypatch):
    """The bookkeeping of a data-parallel rank asks about its own shards only (before: rank 0 summed every marker
    of the store after each shard); the whole store is looked at once, when the run finishes."""
    asked = []
    written = fmt.ShardFiles.written

    def recorded(self, shards=None):
        asked.append(list(range(self.spec.num_shards)) if shards is None else list(shards))
        return written(self, shards)

    monkeypatch.setattr(fmt.ShardFiles, "written", recorded)
    for dp_rank in (3, 2):                                                    # 11 shards: 9-10, then 6-8
        with pytest.raises(ValueError, match="cannot finish"):                # (the other ranks' are missing)
            write(tmp_path / "c", samples_per_shard=1, dp_rank=dp_rank, dp_size=4)
    whole = list(range(11))                                                   # finishing looks at every shard
    assert asked == [[9, 10], [9, 10], whole, [6, 7, 8], [6, 7, 8], whole], asked


def test_reader_caches_keep_their_bound(tmp_path, monkeypatch):
    entry = 40 + ENTRY_BYTES                                                 # 10 int32 values and the bookkeeping
    cache = BoundedCache(max_bytes=2 * entry + 1)
    for key in range(5):
        cache.put(key, np.zeros(10, dtype=np.int32))                         # two fit
        cache.get(0)                                                         # 0 stays the most recent
    assert len(cache) == 2 and cache.get(0) is not None and cache.get(4) is not None and cache.nbytes == 2 * entry
    write(tmp_path / "c", samples_per_shard=1)
    group, spec = fmt.open_store(tmp_path / "c")
    reader = SampleReader(tmp_path / "c", group, spec)
    bound = reader.readers[fmt.IDS]._index_cache.max_bytes
    assert bound <= 1 << 22
    for name in reader.readers:
        reader.readers[name]._index_cache.max_bytes = 2 * (16 + ENTRY_BYTES)  # two one-chunk shard indexes
    reader._records.max_bytes = 2 * (4 * len(reader.bound) + ENTRY_BYTES)   # two shards' records (uint32 [1, A])
    for sample in range(N):
        reader.read(sample)
        assert all(len(each._index_cache) <= 2 for each in reader.readers.values()) and len(reader._records) <= 2


def test_verify_over_two_processes_finds_what_one_finds(tmp_path):
    write(tmp_path / "c")                                                     # 3 shards of 4 samples
    _flip(tmp_path / "c")                                                     # shard 0 (sample 1)
    records = tmp_path / "c" / fmt.RECORDS / "c.2.0"
    records.write_bytes(records.read_bytes()[:-1])                            # shard 2
    group, spec = fmt.open_store(tmp_path / "c")
    one = verify_shards(tmp_path / "c", group, spec, range(3), workers=1)
    two = verify_shards(tmp_path / "c", group, spec, range(3), workers=2, process_tokens=1)
    assert sorted(one) == [0, 2] and one == two
    assert verify_shards(tmp_path / "c", group, spec, [1], workers=2, process_tokens=1) == {}


def test_a_repair_run_marks_the_store_incomplete_until_it_finishes(tmp_path):
    write(tmp_path / "c")
    (tmp_path / "c" / fmt.IDS / "c.1.0.0").unlink()
    import megatron_kd_plugin.cache.writer as writer

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:                               # killed after the damage was removed
        patch.setattr(writer, "write_shard", killed)
        with pytest.raises(KeyboardInterrupt):
            write(tmp_path / "c", repair=True)
    with pytest.raises(ValueError, match=r"unfinished: samples \[4, 8\)"):
        TopKCacheReader(tmp_path / "c")
    write(tmp_path / "c")                                                     # a plain resume completes it
    TopKCacheReader(tmp_path / "c")[5]
    assert zarr.open_group(tmp_path / "c").attrs["complete"] is True
    assert pathlib.Path(tmp_path / "c" / fmt.IDS / "c.1.0.0").is_file()


def test_unsupported_urls_are_refused_in_one_line_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    """Issue 38's first step: ``--output s3://bucket/store`` used to write a local folder named ``s3:`` and report
    success, and a reader given the URL read that folder back; a scheme the store cannot handle (s3:// and msc://
    it can: tests/test_object_store.py) is refused in one line by the writer, the reader, inspect and the command."""
    from megatron_kd_plugin.cache.sources.token_windows import open_source
    from megatron_kd_plugin.commands.cache import main as cache_main
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    monkeypatch.chdir(tmp_path)
    for url in ("gs://bucket/store", "az://container/store", "file:/x/store"):
        scheme = url.split(":")[0]
        with pytest.raises(ValueError, match=f"{url}: a store on {scheme}:// is not supported"):
            write(url)
        with pytest.raises(ValueError, match=f"{url}: a store on {scheme}://"):
            TopKCacheReader(url)
        with pytest.raises(ValueError, match=f"{url}: token data on {scheme}://"):
            open_source(url, 8)
        assert inspect_main([url]) == 2 and "is not supported" in capsys.readouterr().out
    (tmp_path / "docs.jsonl").write_text('{"text": "a b"}\n')
    code = cache_main(["--teacher", "unused", "--teacher-loader", "x:y", "--vocab-size", "3", "--data",
                       str(tmp_path / "docs.jsonl"), "--tokenizer", "t.json", "--output", "gs://bucket/c.zarr",
                       "--seq-length", "8", "--no-progress"])
    assert code == 2 and "gs://bucket/c.zarr: a store on gs:// is not supported" in capsys.readouterr().err
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["docs.jsonl"]
