"""Issue #38: stores on object storage, against a real S3 server (SeaweedFS, the session's ``s3_server`` fixture):
written object for object as on disk, read and verified through ``s3://`` and ``msc://``, resumed byte-identical
after SIGKILL, one writer at a time, damage caught and repaired, one-line errors, a blend of a local and an S3
store, and the train command healing from S3. One store, written once, serves most tests."""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.store.chunk_reader import DamagedStoreError
from megatron_kd_plugin.cache.store.lease import WriterLease
from megatron_kd_plugin.cache.store.lock import LOCK_NAME
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
from megatron_kd_plugin.cache.store.storage import location
from megatron_kd_plugin.cache.writer import refuse_while_written, write_cache
from tests.distributed import scaled
from tests.test_bridge_train import K, SEQ, VOCAB, tiny_overrides
from tests.test_cache_store import same_sample

SAMPLES = 12
REPO = pathlib.Path(__file__).resolve().parents[1]


def teacher(seed: int = 0):
    """A bigram table teacher over the tiny train recipe's vocabulary: [b, s] -> [s, b, V]."""
    import torch

    table = 3 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    return lambda tokens, position_ids=None: table[tokens].transpose(0, 1)


def source(seed: int = 1) -> TokenWindows:
    stream = np.random.default_rng(seed).integers(0, VOCAB, SAMPLES * SEQ + 1)
    return TokenWindows(stream, SEQ, num_samples=SAMPLES, fingerprint=f"objstore-{seed}", tokenizer="synthetic",
                        tokenizer_vocab_size=VOCAB)


def write(output, **options):
    return write_cache(source(), teacher(), output, **(dict(k=K, vocab_size=VOCAB, teacher="bigram",
                                                            samples_per_shard=4, progress=False) | options))


def local_files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name != LOCK_NAME}


def objects(url: str) -> dict[str, bytes]:
    prefix = location(url)
    return {key: prefix.get(key) for key in prefix.keys() if key != LOCK_NAME}


def fresh_url(name: str) -> str:
    return f"s3://kdtest/{uuid.uuid4().hex[:8]}/{name}"


@pytest.fixture(scope="module")
def stores(s3_server, tmp_path_factory):
    """({"local": folder, "s3": url}) of one store written to both places by the same call."""
    folder = tmp_path_factory.mktemp("objstore") / "bigram.zarr"
    url = fresh_url("bigram.zarr")
    write(folder)
    write(url)
    return {"local": folder, "s3": url}


def test_an_s3_store_holds_the_local_stores_bytes_and_reads_back_through_s3_and_msc(stores, capsys):
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    assert objects(stores["s3"]) == local_files(stores["local"])
    local = TopKCacheReader(stores["local"])
    msc_url = "msc://local/" + stores["s3"].removeprefix("s3://")
    for url in (stores["s3"], msc_url):
        remote = TopKCacheReader(url)
        for sample in (0, 5, SAMPLES - 1):
            mine, theirs = remote[sample], local[sample]
            assert same_sample(mine, theirs)
    with pytest.raises(ValueError, match="read by the training process itself .*: set dataset.num_workers=0"):
        pickle.dumps(remote)                                   # a DataLoader worker process cannot take it
    assert inspect_main([stores["s3"], "--verify", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert f"store {stores['s3']}" in out and "verified: every checksum and record of the 12 written samples" in out


def _killed_writer(url: str) -> None:
    """Writes ``url`` and SIGKILLs itself once its first shard is written (a subprocess's body)."""
    import signal

    write(url, on_shard_written=lambda n: n == 1 and os.kill(os.getpid(), signal.SIGKILL))


def test_a_writer_killed_mid_store_leaves_it_unreadable_and_the_rerun_writes_the_same_objects(stores):
    url = fresh_url("killed.zarr")
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from tests.test_object_store import _killed_writer; "
            "_killed_writer(sys.argv[1])")
    killed = subprocess.run([sys.executable, "-c", code, url, str(REPO)], timeout=scaled(300),
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert location(url).exists(LOCK_NAME)                     # the killed run's lease, left behind
    with pytest.raises(ValueError, match=r"is unfinished: samples \[4, 12\) of 12 are not written"):
        TopKCacheReader(url)
    refuse_while_written(url)                                 # the cache command's early check lets the rerun go:
    stats = write(url)                                        # its holder is dead on this host, taken over at once
    assert (stats.shards_written, stats.shards_skipped) == (2, 1)
    assert objects(url) == objects(stores["s3"]) and not location(url).exists(LOCK_NAME)


def test_a_second_writer_is_refused_while_the_first_holds_the_lease(stores):
    url = fresh_url("leased.zarr")
    lease = WriterLease(location(url)).exclusive()
    try:
        with pytest.raises(ValueError, match=rf"another run is writing {url}: its lease .* \(process {os.getpid()}"):
            write(url)
    finally:
        lease.release()
    write(url)                                                # released: the next run writes
    assert objects(url) == objects(stores["s3"])


def test_a_damaged_object_is_caught_on_read_named_by_verify_and_rewritten_by_repair(stores, capsys):
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    url = fresh_url("damaged.zarr")
    prefix = location(url)
    for key, data in objects(stores["s3"]).items():            # a copy of the store, as `aws s3 sync` makes one
        prefix.put(key, data)
    TopKCacheReader(url)[5]
    shard = bytearray(prefix.get("teacher_ids/c.1.0.0"))
    shard[10] ^= 0x20                                         # a bit flipped inside sample 4's chunk
    prefix.put("teacher_ids/c.1.0.0", bytes(shard))
    with pytest.raises(DamagedStoreError, match=rf"{url}/teacher_ids/c.1.0.0 \(samples \[4, 8\)\), chunk .*CRC32C"):
        TopKCacheReader(url)[4]
    assert inspect_main([url, "--verify", "--workers", "1"]) == 2
    assert "1 of 3 written shards" in capsys.readouterr().out
    write(url, repair=True)
    assert objects(url) == objects(stores["s3"])


def test_object_store_failures_are_one_line_and_nothing_of_the_users_is_deleted(stores, s3_server, monkeypatch):
    with pytest.raises(ValueError, match=r"^s3://no-such-bucket-kd/x: the bucket 'no-such-bucket-kd' does not exist"):
        TopKCacheReader("s3://no-such-bucket-kd/x")
    url = fresh_url("users.zarr")
    location(url).put("notes.txt", b"the user's")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=rf"{url} is not a cache store written by this tool \(it holds the "
                                             rf"object {url}/notes.txt"):
            write(url, overwrite=overwrite)
    assert objects(url) == {"notes.txt": b"the user's"}
    with pytest.raises(ValueError, match=r"^s3://kdtest/nothing: not a teacher cache|is not a teacher cache"):
        TopKCacheReader("s3://kdtest/nothing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ValueError, match=rf"^{stores['s3']}: the object store refused the credentials"):
        TopKCacheReader(stores["s3"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=rf"^{stores['s3']}: the object store at http://127.0.0.1:9 does not answer"):
        TopKCacheReader(stores["s3"])


def test_a_blend_of_a_local_and_an_s3_store_reads_each_as_its_own(stores):
    import torch
    from megatron.bridge.data.base import DatasetBuildContext

    from megatron_kd_plugin.commands.train import build_config

    def train_rows(*overrides):
        cfg = build_config("tiny_gpt_kd_cpu_fp32_config", tiny_overrides("unused", *overrides)[1:])
        return cfg.dataset.build_datasets(DatasetBuildContext(train_samples=16, valid_samples=0, test_samples=0))[0]

    blend = train_rows(f"dataset.blend='0.5 {stores['local']} 0.5 {stores['s3']}'")
    alone = [train_rows(f"dataset.cache_path={stores[name]}") for name in ("local", "s3")]
    for row in range(16):
        part, part_row = blend.source_of(row)
        mine, theirs = blend[row], alone[part][part_row]
        assert int(mine.source) == part and torch.equal(mine.tokens, theirs.tokens)
        assert torch.equal(mine.teacher.ids, theirs.teacher.ids)
    assert {blend.source_of(row)[0] for row in range(16)} == {0, 1}


def test_the_train_command_heals_a_student_from_an_s3_store(stores, tmp_path):
    command = [sys.executable, "-m", "megatron_kd_plugin", "train", "--recipe", "tiny_gpt_kd_cpu_fp32_config",
               *tiny_overrides(stores["s3"], "train.train_iters=2", "logger.log_interval=1")]
    env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    losses = [float(re.search(r"\| kd loss: ([0-9.]+)", line).group(1)) for line in done.stdout.splitlines()
              if re.match(r"iteration +[12]/ +2 ", line)]
    assert len(losses) == 2 and losses[1] < losses[0], done.stdout[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_indexed_dataset_on_s3_is_the_same_token_source_as_its_local_copy(stores, tmp_path, monkeypatch):
    """``cache --data s3://...``: the .idx cached locally (megatron-core's index cache path), the .bin read by
    ranges; same windows and fingerprint as the local files, so the store written from it is the same store."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    import megatron_kd_plugin.cache.sources.object_tokens as object_tokens
    from megatron_kd_plugin.cache.sources.token_windows import open_source

    monkeypatch.setattr(object_tokens, "INDEX_CACHE", tmp_path / "idx_cache")
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(3)
    for length in rng.integers(5, 40, 30):
        builder.add_document(rng.integers(0, VOCAB, length).astype(np.int32), [int(length)])
    builder.finalize(prefix + ".idx")
    url = fresh_url("data/corpus")
    folder = location(url.rpartition("/")[0])
    for suffix in (".idx", ".bin"):
        folder.put(f"corpus{suffix}", pathlib.Path(prefix + suffix).read_bytes())
    local, remote = open_source(prefix, SEQ), open_source(url, SEQ)
    assert len(remote) == len(local) and remote.fingerprint == local.fingerprint
    assert (remote.windows(0, len(local)) == local.windows(0, len(local))).all()
    assert (tmp_path / "idx_cache" / url.removeprefix("s3://")).with_suffix(".idx").is_file()
    with pytest.raises(ValueError, match=rf"indexed dataset file {url}x.idx does not exist"):
        open_source(url + "x", SEQ)
    store = fresh_url("from_s3_data.zarr")
    options = dict(k=K, vocab_size=VOCAB, teacher="bigram", samples_per_shard=4, progress=False)
    write_cache(remote, teacher(), store, **options)
    write_cache(local, teacher(), tmp_path / "local.zarr", **options)
    assert objects(store) == local_files(tmp_path / "local.zarr")


def test_copy_moves_a_store_to_s3_and_back_valid_throughout_and_refuses_an_occupied_place(stores, tmp_path, capsys):
    from megatron_kd_plugin.__main__ import main

    url = fresh_url("copied.zarr")
    assert main(["copy", str(stores["local"]), url, "--no-progress", "--verify-workers", "1"]) == 0
    assert "every chunk of the copy verified" in capsys.readouterr().out
    assert objects(url) == local_files(stores["local"])
    back = tmp_path / "back.zarr"
    assert main(["copy", url, str(back), "--no-progress", "--verify-workers", "1"]) == 0
    assert local_files(back) == local_files(stores["local"])
    assert main(["copy", url, str(back), "--no-progress"]) == 2
    assert "already holds a store" in capsys.readouterr().out
    half = fresh_url("half.zarr")                             # a copy killed before its root zarr.json
    for key, data in list(objects(url).items())[:5]:
        if key != "zarr.json":
            location(half).put(key, data)
    with pytest.raises(ValueError, match="is not a teacher cache"):
        TopKCacheReader(half)
    assert main(["copy", url, half, "--no-progress", "--verify-workers", "1"]) == 0
    assert objects(half) == objects(url)


PART = 5 << 20
"""S3's smallest multipart part (SeaweedFS enforces it): the tests' part size, so an 11 MB file goes in 3 parts."""
BIG = "teacher_ids/c.9.0.0"
"""A chunk file past the store's last shard (readers and verification never read it): the file larger than a part."""


@pytest.fixture(scope="module")
def big_store(stores, tmp_path_factory):
    """A copy of the local store holding also :data:`BIG`, 11 MB of random bytes."""
    folder = tmp_path_factory.mktemp("bigcopy") / "big.zarr"
    for key, data in local_files(stores["local"]).items():
        location(folder).put(key, data)
    location(folder).put(BIG, np.random.default_rng(0).bytes(2 * PART + (1 << 20)))
    return folder


def _killed_copy(source: str, destination: str, after: int) -> None:
    """Copies ``source`` to ``destination`` one file at a time and SIGKILLs itself once ``after`` files are in
    place (a subprocess's body)."""
    import signal

    from megatron_kd_plugin.cache.store.store_copy import copy_store

    copied = []

    def count(key: str) -> None:
        copied.append(key)
        if len(copied) == after:
            os.kill(os.getpid(), signal.SIGKILL)

    copy_store(source, destination, workers=1, on_file_copied=count)


def test_copy_streams_files_larger_than_a_part_to_s3_and_back_byte_identical(big_store, tmp_path):
    from megatron_kd_plugin.cache.store.store_copy import copy_store

    url, back = fresh_url("big.zarr"), tmp_path / "back.zarr"
    files = local_files(big_store)
    stats = copy_store(big_store, url, workers=4, part_bytes=PART, piece_bytes=1 << 16)
    assert (stats.files_copied, stats.bytes_copied) == (len(files), sum(map(len, files.values())))
    assert location(url).head(BIG)["e_tag"].strip('"').endswith("-3")   # a multipart upload of 3 parts
    assert objects(url) == files
    copy_store(url, back, workers=4, piece_bytes=1000)                  # reads smaller than every file
    assert local_files(back) == files


def test_a_copy_killed_midway_reruns_copying_only_the_files_it_had_not_finished(stores):
    url, copy = stores["s3"], fresh_url("killed-copy.zarr")
    code = ("import sys; sys.path.insert(0, sys.argv[3]); from tests.test_object_store import _killed_copy; "
            "_killed_copy(sys.argv[1], sys.argv[2], 5)")
    killed = subprocess.run([sys.executable, "-c", code, url, copy, str(REPO)], timeout=scaled(300),
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    with pytest.raises(ValueError, match="is not a teacher cache"):
        TopKCacheReader(copy)
    from megatron_kd_plugin.cache.store.store_copy import copy_store

    files = objects(url)
    stats = copy_store(url, copy)
    assert (stats.files_kept, stats.files_copied) == (5, len(files) - 5)
    assert stats.bytes_kept + stats.bytes_copied == sum(map(len, files.values()))
    assert objects(copy) == files


def test_a_copy_killed_mid_multipart_upload_reruns_the_unfinished_file_and_leaves_the_upload_on_the_server(
        big_store, s3_server):
    import time

    from megatron_kd_plugin.cache.store.store_copy import copy_store

    copy, files = fresh_url("killed-upload.zarr"), local_files(big_store)
    bucket, prefix = copy.removeprefix("s3://").split("/", 1)
    child = subprocess.Popen([sys.executable, "-m", "tests.stalled_copy", str(big_store), copy, BIG,
                              str(PART + (1 << 20))], stderr=subprocess.PIPE, text=True, cwd=REPO)
    others = set(files) - {BIG, "zarr.json"}
    try:
        deadline = time.monotonic() + scaled(120)
        while True:                 # until the other files are in place and a part of the big one is on the server
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()[-2000:]
            if s3_server.multipart_uploads(bucket, f"{prefix}/{BIG}").get(f"{prefix}/{BIG}", 0) >= 1 and \
                    set(location(copy).keys()) == others:
                break
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -9
    assert set(location(copy).keys()) == others                # nothing of the unfinished file appears
    with pytest.raises(ValueError, match="is not a teacher cache"):
        TopKCacheReader(copy)
    stats = copy_store(big_store, copy)                        # the rerun (verified: every chunk's CRC32C)
    assert (stats.files_copied, stats.files_kept) == (2, len(files) - 2)   # the big file and the root zarr.json
    assert objects(copy) == files
    assert location(copy).head(BIG)["e_tag"].strip('"').endswith("-3")
    # the killed upload stays on the server, invisible to listings, until aborted (docs/object-storage.md)
    assert s3_server.multipart_uploads(bucket, prefix) == {f"{prefix}/{BIG}": 1}
    s3_server.abort_multipart_uploads(bucket, prefix)
    assert s3_server.multipart_uploads(bucket, prefix) == {}


def test_an_upload_whose_source_fails_midway_is_aborted_leaving_neither_object_nor_upload(s3_server):
    url = fresh_url("failed-source")
    bucket, prefix = url.removeprefix("s3://").split("/", 1)

    def failing():
        yield from (bytes(1 << 20) for _ in range(PART // (1 << 20) + 1))   # a part sent, the next one begun
        raise OSError("the source disk failed")

    with pytest.raises(OSError, match="the source disk failed"):
        location(url).write_pieces("big", failing(), part_bytes=PART)
    assert location(url).keys() == [] and s3_server.multipart_uploads(bucket, prefix) == {}


def test_copy_onto_an_occupied_s3_prefix_is_refused_in_one_line_and_nothing_there_touched(stores, capsys):
    from megatron_kd_plugin.__main__ import main

    foreign = fresh_url("foreign")
    location(foreign).put("notes.txt", b"the user's")
    for destination, words in ((foreign, "is not empty and not an interrupted copy of a store"),
                               (stores["s3"], "already holds a store")):
        before = objects(destination)
        assert main(["copy", str(stores["local"]), destination, "--no-progress"]) == 2
        out = capsys.readouterr().out
        assert out.startswith(f"error: {destination} ") and words in out and out.count("\n") == 1
        assert objects(destination) == before


HEAVY = ("torch", "megatron", "transformers")
"""What the copy command must not import (the store's description is numpy and zarr)."""


def test_the_copy_command_and_its_verification_import_no_torch(stores, tmp_path):
    code = ("import sys; from megatron_kd_plugin.__main__ import main; "
            "code = main(['copy', sys.argv[1], sys.argv[2], '--no-progress', '--verify-workers', '1']); "
            "print(code, sorted({name.split('.')[0] for name in sys.modules} & set(sys.argv[3:])))")
    done = subprocess.run([sys.executable, "-c", code, str(stores["local"]), str(tmp_path / "copy.zarr"), *HEAVY],
                          capture_output=True, text=True, timeout=scaled(120), cwd=REPO)
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr[-2000:]
    assert local_files(tmp_path / "copy.zarr") == local_files(stores["local"])


def test_a_file_of_the_right_size_but_other_bytes_is_rewritten_and_a_foreign_place_refused(stores, tmp_path, capsys):
    from megatron_kd_plugin.__main__ import main
    from megatron_kd_plugin.cache.store.store_copy import copy_store

    files, half = local_files(stores["local"]), tmp_path / "half.zarr"
    for key, data in files.items():                           # an interrupted copy: no root zarr.json, one file
        if key != "zarr.json":                                # damaged in place, one temporary of a killed write
            location(half).put(key, bytes([data[0] ^ 1]) + data[1:] if key == "teacher_ids/c.1.0.0" else data)
    (half / "teacher_ids" / f"c.2.0.0.{uuid.uuid4().hex}.partial").write_bytes(b"half a shard")
    stats = copy_store(stores["local"], half)
    assert (stats.files_copied, stats.files_kept) == (2, len(files) - 2)   # the damaged file and the root zarr.json
    assert local_files(half) == files
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("the user's")
    assert main(["copy", str(stores["local"]), str(foreign), "--no-progress"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: ") and "is not empty and not an interrupted copy of a store" in out
    assert out.count("\n") == 1 and (foreign / "notes.txt").read_text() == "the user's"
