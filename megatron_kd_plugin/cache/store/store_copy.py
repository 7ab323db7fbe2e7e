"""Copies a complete store between places (a local folder, ``s3://``, ``msc://``: ``storage.py``) so that it stays
a valid store at every moment: every file but the root zarr.json first, in parallel, then the root zarr.json (its
attributes: what makes the copy a store, and a complete one), then every chunk of the copy read back and checked
(``records.SampleReader.verify``: CRC32C, records, ids). A copy killed midway has no root zarr.json, so readers
refuse it ("not a teacher cache"), and the same command finishes it.

The destination must be empty, or hold what an interrupted copy of the same store left (files of the store's
layout and no root zarr.json); anything else there is refused, nothing of it deleted.
"""

from __future__ import annotations

import concurrent.futures
import pathlib

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.lock import LOCK_NAME
from megatron_kd_plugin.cache.store.reader import TopKCacheReader
from megatron_kd_plugin.cache.store.records import verify_shards


def copy_store(source, destination, *, workers: int = 16, verify_workers: int = 1, progress: bool = False) -> int:
    """Copies the complete store at ``source`` to ``destination`` (module docstring) with ``workers`` threads, then
    verifies the copy with ``verify_workers`` processes; returns the bytes copied. ValueError (one line) for an
    incomplete or damaged source, a destination holding anything else, or a copy that does not verify."""
    from tqdm import tqdm

    reader = TopKCacheReader(source)                       # refuses an unfinished or inconsistent store
    origin, target = fmt.files_of(reader.path), fmt.files_of(fmt.store_location(destination))
    _check_destination(target)
    keys = [key for key in origin.keys() if key != LOCK_NAME and not fmt.is_partial(pathlib.PurePosixPath(key))]
    body = [key for key in keys if key != "zarr.json"]

    def copy(key: str) -> int:
        data = origin.get(key)
        target.put(key, data)
        return len(data)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
            tqdm(total=len(keys), unit="file", desc="copying", disable=not progress) as bar:
        copied = 0
        for size in pool.map(copy, body):
            copied += size
            bar.update()
        copied += copy("zarr.json")
        bar.update()
    copy_path = fmt.store_location(destination)
    group, spec = fmt.open_store(copy_path)
    damaged = verify_shards(copy_path, group, spec, fmt.ShardFiles(copy_path, group, spec).written(),
                            workers=verify_workers, progress=progress)
    if damaged:
        shard, message = next(iter(damaged.items()))
        raise ValueError(f"the copy {target} does not verify: {len(damaged)} shards differ from the source's "
                         f"(shard {shard}: {message})")
    return copied


def _check_destination(target) -> None:
    if isinstance(target, storage.LocalFolder):
        if not target.path.exists() or (target.path.is_dir() and not any(target.path.iterdir())):
            return
        where = target.path
    else:
        if target.is_empty(ignore=LOCK_NAME):
            return
        where = target
    if target.exists("zarr.json"):
        raise ValueError(f"{target} already holds a store (or something with a zarr.json): copy into an empty place, "
                         "or remove it yourself first")
    foreign = fmt.foreign_entries(where, named=False)
    if foreign:
        raise ValueError(f"{target} is not empty and not an interrupted copy of a store ({'; '.join(foreign[:3])}): "
                         "copy into an empty place")
