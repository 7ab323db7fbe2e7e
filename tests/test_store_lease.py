"""Issue #51: the writers' lease of a store on object storage (``cache/store/lease.py``) at cluster scale, against
the real S3 server (SeaweedFS): a run that lost its lease stops before its next shard, a dead holder's lease is
taken over once expired and not before, a server without conditional writes is served by the safe rule, and a
bucket that vanishes, or a key the server deactivates, under an open reader fail its reads in one line. The stores are the
12-sample ones of ``test_object_store.py``."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.store import lease, storage
from megatron_kd_plugin.cache.store.chunk_reader import DamagedStoreError
from megatron_kd_plugin.cache.store.lease import WriterLease
from megatron_kd_plugin.cache.store.lock import LOCK_NAME
from megatron_kd_plugin.cache.store.storage import location
from tests.distributed import scaled
from tests.test_object_store import fresh_url, objects, stores, write  # noqa: F401 (stores: the module fixture)

OTHER = {"id": "another-run", "host": "another-host", "pid": 1}
"""The holder of a lease taken by a run on another host (so no dead-process rule of this host applies)."""


def take_as_other_run(url: str) -> None:
    """The lease object of ``url`` rewritten as another run's (what a run that took it over leaves there)."""
    location(url).put(LOCK_NAME, json.dumps(OTHER).encode())


def shards_with_objects(url: str) -> set[int]:
    """The shards (first chunk coordinate) of which any chunk object exists under ``url``."""
    return {int(found.group(1)) for key in location(url).keys() if (found := re.search(r"/c\.(\d+)(\.|$)", key))}


def refuse_each_read(reader: TopKCacheReader, message: str) -> None:
    """Sample 0 (its shard index cached) read at once, and sample 4 read ahead, both fail with ``message``."""
    with pytest.raises(ValueError, match=message):
        reader[0]
    reader.hint([4, 5])                                         # read ahead: the error surfaces where asked for
    with pytest.raises(ValueError, match=message):
        reader[4]


def test_a_run_that_lost_its_lease_writes_no_further_shard_and_the_rerun_finishes_the_store(stores):
    url = fresh_url("lost.zarr")
    lost = rf"^{url}: this run lost its writers' lease {url}/{LOCK_NAME} \(process 1 on another-host holds it now\)"
    with pytest.raises(ValueError, match=lost):
        write(url, on_shard_written=lambda written: written == 1 and take_as_other_run(url))
    assert shards_with_objects(url) == {0}
    assert json.loads(location(url).get(LOCK_NAME)) == OTHER     # the other run's lease is not deleted
    location(url).delete(LOCK_NAME)                             # that run ends
    stats = write(url)
    assert (stats.shards_written, stats.shards_skipped) == (2, 1)
    assert objects(url) == objects(stores["s3"]) and not location(url).exists(LOCK_NAME)


def test_every_ranks_handle_fails_its_check_once_the_lease_names_another_holder(s3_server):
    prefix = location(fresh_url("ranks.zarr"))
    rank0 = WriterLease(prefix).exclusive()
    try:
        other_rank = WriterLease(prefix).shared()               # a rank that joins the run: rank 0's holder id
        rank0.check(), other_rank.check()
        take_as_other_run(prefix.url)
        for handle in (rank0, other_rank):
            with pytest.raises(ValueError, match=r"this run lost its writers' lease .* \(process 1 on another-host"):
                handle.check()
    finally:
        rank0.release()
    assert json.loads(prefix.get(LOCK_NAME)) == OTHER
    prefix.delete(LOCK_NAME)
    with pytest.raises(ValueError, match=rf"^{prefix.url}: this run lost .* \(its lease object was deleted"):
        WriterLease(prefix).shared()


@pytest.mark.parametrize("conditional_put", ["etag", "disabled"])
def test_a_dead_holders_lease_on_another_host_is_taken_over_once_expired_and_not_before(
        stores, monkeypatch, capsys, conditional_put):
    """``disabled``: the client sends no conditions (``AWS_CONDITIONAL_PUT``), as for a server that rejects them;
    the same rule refuses a live lease. A dead holder on this host is taken over at once: the kill test of
    ``test_object_store.py``."""
    expiry = scaled(3.0)        # long enough for the refusal on a loaded machine, short enough to wait out
    monkeypatch.setattr(lease, "LEASE_SECONDS", expiry)
    monkeypatch.setenv("AWS_CONDITIONAL_PUT", conditional_put)
    url = fresh_url("expired.zarr")
    take_as_other_run(url)
    with pytest.raises(ValueError, match=rf"^another run is writing {url}: its lease {url}/{LOCK_NAME} \(process 1 "
                                         r"on another-host\) was renewed \d+ s ago and expires \d+ s after"):
        write(url)
    time.sleep(expiry + 0.2)                                    # past the expiry, by the server's Last-Modified
    write(url)
    assert objects(url) == objects(stores["s3"]) and not location(url).exists(LOCK_NAME)
    unsupported = f"{url}: the object store does not support conditional writes"
    assert (unsupported in capsys.readouterr().out) == (conditional_put == "disabled")


def test_a_server_that_ignores_conditional_writes_is_detected_and_a_live_lease_still_refuses(
        stores, monkeypatch, capsys):
    """Such a server answers every conditional PUT with success and writes it: here the client drops the
    conditions before sending (the server is the real one)."""
    put = storage.ObjectPrefix.put
    monkeypatch.setattr(storage.ObjectPrefix, "put", lambda self, key, data, mode=None: put(self, key, data))
    url = fresh_url("ignored.zarr")
    take_as_other_run(url)
    with pytest.raises(ValueError, match=rf"^another run is writing {url}: its lease .* \(process 1 on another-host"):
        write(url)
    assert json.loads(location(url).get(LOCK_NAME)) == OTHER
    location(url).delete(LOCK_NAME)                             # that run ends
    write(url)
    assert f"{url}: the object store ignores conditional writes" in capsys.readouterr().out
    assert objects(url) == objects(stores["s3"])


def test_a_bucket_that_vanishes_under_a_reader_fails_each_read_in_one_line_naming_it(stores, s3_server):
    bucket = f"kdgone{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    url = f"s3://{bucket}/bigram.zarr"
    prefix = location(url)
    for key, data in objects(stores["s3"]).items():
        prefix.put(key, data)
    reader = TopKCacheReader(url)
    reader[0]                                                   # shard 0's index read and cached
    prefix.delete(prefix.keys())
    with pytest.raises(DamagedStoreError, match=rf"^{url} was replaced \(or removed\) since this reader opened it .*"
                                                rf"\({url}/teacher_ids/c.2.0.0 \(samples \[8, 12\)\) is missing"):
        reader[8]
    s3_server.delete_bucket(bucket)
    refuse_each_read(reader, rf"^{url}: the bucket '{bucket}' does not exist")


def test_a_key_deactivated_under_an_open_reader_fails_each_read_in_one_line_naming_the_store(
        stores, s3_server, monkeypatch):
    """A key revoked (or expired) while a reader is open: the server itself deactivates the key the reader's client
    signs with (SeaweedFS's IAM API) and refuses it from then on."""
    user = f"kdreader{uuid.uuid4().hex[:8]}"
    key_id, secret = s3_server.new_access_key(user)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    url = stores["s3"]
    reader = TopKCacheReader(url)
    reader[0]
    s3_server.deactivate_access_key(user, key_id)
    refused = rf"^{url}: the object store refused the credentials \(InvalidAccessKeyId\)"
    deadline = time.monotonic() + scaled(60)
    while time.monotonic() < deadline:                          # the server applies the change within a moment
        try:
            location(url).exists("zarr.json")
        except ValueError:
            break
        time.sleep(0.1)
    refuse_each_read(reader, refused)
