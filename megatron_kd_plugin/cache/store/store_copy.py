"""Copies a complete store between places (a local folder, ``s3://``, ``msc://``: ``storage.py``) so that it stays
a valid store at every moment: every file but the root zarr.json first, in parallel, then the root zarr.json (its
attributes: what makes the copy a store, and a complete one), then every chunk of the copy read back and checked
(``records.SampleReader.verify``: CRC32C, records, ids). A copy killed midway has no root zarr.json, so readers
refuse it ("not a teacher cache"), and the same command finishes it.

Memory is bounded whatever the file sizes: each file moves in pieces (``read_pieces``: 1 MiB reads of a file or of
one GET's body) written as they come (``write_pieces``: a temporary file renamed into place, or a multipart upload
completed at the end), so a copy holds at most ``workers`` files' pieces and parts at once (docs/object-storage.md).
Every destination write is atomic, so a file the copy finds there is whole: one of the source's size and CRC32C
(both read streaming) is kept, anything else rewritten; a rerun of a killed copy moves only what it had not finished.

The destination must be empty, or hold what an interrupted copy of the same store left (files of the store's
layout and no root zarr.json); anything else there is refused, nothing of it deleted.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import google_crc32c

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.lock import LOCK_NAME
from megatron_kd_plugin.cache.store.records import verify_shards


@dataclass(frozen=True, kw_only=True)
class CopyStats:
    """What a copy moved."""

    files_copied: int = 0
    """Files written to the destination."""
    bytes_copied: int = 0
    """Their bytes."""
    files_kept: int = 0
    """Files the destination already held whole (the source's size and CRC32C): an interrupted copy's."""
    bytes_kept: int = 0
    """Their bytes."""

    def __add__(self, other: "CopyStats") -> "CopyStats":
        return CopyStats(files_copied=self.files_copied + other.files_copied,
                         bytes_copied=self.bytes_copied + other.bytes_copied,
                         files_kept=self.files_kept + other.files_kept, bytes_kept=self.bytes_kept + other.bytes_kept)


def copy_store(source, destination, *, workers: int = 16, verify_workers: int = 1, progress: bool = False,
               part_bytes: int = storage.MIN_PART_BYTES, piece_bytes: int = storage.PIECE_BYTES,
               on_file_copied: Callable[[str], object] | None = None) -> CopyStats:
    """Copies the complete store at ``source`` to ``destination`` (module docstring) with ``workers`` threads, then
    verifies the copy with ``verify_workers`` processes. ``part_bytes``: an object store's multipart part size
    (>= 5 MiB); ``piece_bytes``: the size of each read; ``on_file_copied(key)``: called once each file is in place.
    ValueError (one line) for an incomplete or damaged source, a destination holding anything else, or a copy that
    does not verify."""
    fmt.open_finished_store(source)                        # refuses an unfinished or inconsistent store
    origin, target = fmt.files_of(fmt.store_location(source)), fmt.files_of(fmt.store_location(destination))
    _check_destination(target)
    fmt.remove_partials(fmt.store_location(destination))  # a killed local copy's temporaries
    sizes = {key: size for key, size in origin.sizes().items()
             if key != LOCK_NAME and not fmt.is_partial(pathlib.PurePosixPath(key))}
    stats = copy_files(origin, target, sizes, workers=workers, progress=progress, part_bytes=part_bytes,
                       piece_bytes=piece_bytes, on_file_copied=on_file_copied)
    _verify_copy(fmt.store_location(destination), target, verify_workers, progress)
    return stats


def copy_files(origin, target, sizes: dict[str, int], *, workers: int, progress: bool = False,
               part_bytes: int = storage.MIN_PART_BYTES, piece_bytes: int = storage.PIECE_BYTES,
               on_file_copied: Callable[[str], object] | None = None) -> CopyStats:
    """Copies the files ``sizes`` ({key: bytes}) of ``origin`` to ``target`` (two ``storage`` places), ``workers``
    at a time and the root zarr.json last, each streamed (module docstring); a file ``target`` already holds whole
    (same size and CRC32C) is kept. ``progress``: a bar in bytes on stderr."""
    from tqdm import tqdm

    there = target.sizes()
    body = [key for key in sizes if key != "zarr.json"]

    def move(key: str) -> CopyStats:
        if there.get(key) == sizes[key] and crc32c(origin, key, piece_bytes) == crc32c(target, key, piece_bytes):
            return CopyStats(files_kept=1, bytes_kept=sizes[key])
        target.write_pieces(key, origin.read_pieces(key, piece_bytes), part_bytes=part_bytes)
        if on_file_copied is not None:
            on_file_copied(key)
        return CopyStats(files_copied=1, bytes_copied=sizes[key])

    stats = CopyStats()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, \
            tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="copying", disable=not progress) as bar:
        for key, moved in zip(body, pool.map(move, body)):
            stats += moved
            bar.update(sizes[key])
        if "zarr.json" in sizes:
            stats += move("zarr.json")
            bar.update(sizes["zarr.json"])
    return stats


def crc32c(files, key: str, piece_bytes: int = storage.PIECE_BYTES) -> int:
    """The CRC32C of the file ``key`` of ``files`` (a ``storage`` place), read ``piece_bytes`` at a time."""
    value = 0
    for piece in files.read_pieces(key, piece_bytes):
        value = google_crc32c.extend(value, piece)
    return value


def _verify_copy(copy_path, target, verify_workers: int, progress: bool) -> None:
    group, spec = fmt.open_store(copy_path)
    damaged = verify_shards(copy_path, group, spec, fmt.ShardFiles(copy_path, group, spec).written(),
                            workers=verify_workers, progress=progress)
    if damaged:
        shard, message = next(iter(damaged.items()))
        raise ValueError(f"the copy {target} does not verify: {len(damaged)} shards differ from the source's "
                         f"(shard {shard}: {message})")


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
