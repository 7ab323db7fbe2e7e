"""Writes a teacher top-K store (format: ``format.py``) from a token source and a teacher: its final hidden states and
lm_head shard, turned into the store kind's rows block by block by the fused head (``teacher_head.py``), or logits a
synthetic teacher formed.

Parallelism: every rank of a tensor-parallel group runs the teacher on the same micro-batch and gets the same
top-K (``topk.py``) or the same draws (``draws.py``, uniforms from (sample_seed, sample index)); only its TP rank
0 writes. Data-parallel groups own disjoint, contiguous ranges of whole
shards, so no two writers touch one file. Global rank 0 alone creates the store and rewrites its attributes.

Resume: a shard is processed from its samples alone, in micro-batches that never cross a shard, so a shard
redone after a kill is bit-identical to the first attempt; a restart with the same settings skips the shards
already written (``format.ShardFiles``). Global rank 0 checks only the store's metadata; each data-parallel group
then checks its own shards (the files of its written shards present) in parallel with the others, so no rank waits
on work proportional to the whole store. The temporaries a kill left between zarr's write and rename are deleted
when the run finishes. A store with other settings at the path is replaced only with ``overwrite``; a path holding
anything that is not a store of this project (a user's folder or file) is never written into nor deleted.

Bookkeeping: a writer keeps no shared progress (no marker array to rescan, no metadata rewritten per shard), so the
cost of a shard's bookkeeping is the same at the millionth shard as at the first; the source's fingerprint and token
range (one pass over its files) are computed once, on global rank 0, and handed to the other ranks.

Repair (``repair``): the same settings as the run that wrote the store; every data-parallel group reads and checks
(``records.py``) its own written shards, in parallel, and deletes the damaged ones, so the shard loop rewrites
exactly those, byte for byte what a clean run writes.

One run at a time: every process holds the store's writers' lock (``lock.py``) for the whole run, so a second run
on the same store is refused while any process of the first lives; on object storage rank 0 holds a lease object
renewed by conditional writes instead (``lease.py``).

Object storage (``s3://``, ``msc://``; ``storage.py``): the same steps, each file one atomic PUT instead of a
write and a rename (``format.create_store`` writes the root zarr.json last; a shard's records after its data), so
a store there is readable only when complete, and a run killed at any moment resumes to the same objects.
"""

from __future__ import annotations

import concurrent.futures
import errno
import pathlib
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import zarr

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store.chunk_reader import REPAIR
from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.lease import WriterLease, writer_lock
from megatron_kd_plugin.cache.store.lock import LOCK_NAME, WriterLock
from megatron_kd_plugin.cache.store.records import SampleReader, shard_records
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
from megatron_kd_plugin.cache.kinds.topk import vocab_parallel_label_logprobs
from megatron_kd_plugin.cache.teacher_context_parallel import check_cp_seq_length, cp_size_of, gather_rows, rank_chunks
from megatron_kd_plugin.cache.teacher_head import DEFAULT_CHUNK_BYTES, TeacherOutput, head_rows, teacher_output

TeacherFn = Callable[[torch.Tensor, torch.Tensor], "TeacherOutput | torch.Tensor | None"]
"""(tokens int64 ``[b, s]``, position_ids int64 ``[b, s]``) -> this rank's teacher output: a
``teacher_head.TeacherHidden`` (hidden states and lm_head shard), or vocab-parallel logits ``[s, b, V/tp]``; None on
pipeline stages before the last. The positions restart at 0 at every document of a row, and the teacher attends
within each document only (``megatron_kd_plugin.documents``); a stream row is one document, 0..s-1."""


@dataclass(kw_only=True)
class WriteStats:
    """What one rank did."""

    shards_written: int = 0
    """Shards this rank computed (and, on TP rank 0, wrote)."""
    shards_skipped: int = 0
    """Shards of this rank already marked done (resume)."""
    tokens: int = 0
    """Tokens this rank computed."""
    forward_seconds: float = 0.0
    """Wall time inside the teacher forward (``teacher_fn``)."""
    total_seconds: float = 0.0
    """Wall time of the whole shard loop (forward, top-K, sort, compression, writes)."""

    @property
    def overhead(self) -> float:
        """Total time over plain forward time (1.0 = no overhead)."""
        return self.total_seconds / self.forward_seconds if self.forward_seconds else float("nan")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


def _agreed(fn, *args, everywhere: bool = False):
    """``fn(*args)`` on global rank 0 (``everywhere``: on every rank), its result returned there; a ValueError or
    OSError of any rank is raised on every rank (no rank left waiting)."""
    rank, world = _world()
    result, failure = None, None
    if everywhere or rank == 0:
        try:
            result = fn(*args)
        except (ValueError, OSError) as exc:
            if world == 1:
                raise
            failure = (isinstance(exc, OSError), str(exc))
    if world > 1:
        failures = [None] * world
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        if result is not None and hasattr(result, "release"):
            result.release()
        is_os_error, message = failure
        raise (OSError if is_os_error else ValueError)(message)
    return result


def other_settings(output, differences: dict[str, tuple]) -> ValueError:
    """The one-line refusal of the store at ``output``, written with other settings (``differences``:
    ``CacheSpec.differences``, requested first); the fingerprint named with what it covers."""
    named = {"fingerprint": "fingerprint (of the data and how they are cut into rows: input kind, layout, loss-mask "
                            "and split settings)"}
    listed = "; ".join(f"{named.get(key, key)}: requested {new!r}, on disk {old!r}"
                       for key, (new, old) in differences.items())
    return ValueError(f"{output} already holds a store written with other settings ({listed}); pass --overwrite to "
                      "replace it, or choose another --output (--repair rewrites the damaged shards of a store "
                      "written with the same settings only)")


def prepare_store(output: pathlib.Path, spec: fmt.CacheSpec, overwrite: bool) -> WriterLock:
    """Creates the store, or keeps an existing one with exactly ``spec`` (a resume: its shards are checked by their
    owners, :func:`prepare_shards`); returns its writers' lock, held exclusively by this process. Constant time in the
    size of a kept store (its metadata only).

    A store of this project with other settings, of an older format version, or with unreadable metadata is
    replaced only with ``overwrite`` (its contents deleted, the folder kept); a path that is not a store of this
    project (a folder with other files or without this tool's zarr.json, a regular file, a link) is refused,
    ``overwrite`` or not, naming what it holds; an empty folder is written into (kept: a mount point works). A live
    writer of the store is refused (ValueError).
    """
    if isinstance(output, storage.ObjectPrefix):
        return _prepare_objects(output, spec, overwrite)
    if output.is_dir() and not output.is_symlink() and (not any(output.iterdir()) or fmt.interrupted_creation(output)):
        fmt.create_store(output, spec)
        return WriterLock(output).exclusive()
    if output.exists() or output.is_symlink():
        _refuse_foreign(output, overwrite, deep=False)
        lock = WriterLock(output).exclusive()
        try:
            try:
                group, on_disk = fmt.open_store(output, mode="r+")
                differences = spec.differences(on_disk)
                if group.attrs["version"] != spec.format_version:
                    differences["version"] = (spec.format_version, group.attrs["version"])
            except ValueError as exc:
                differences = {"store": (f"a cache with {spec}", f"unreadable ({exc})")}
            if not differences:
                return lock
            _refuse_foreign(output, overwrite, deep=True)      # replacing deletes every file it holds: all ours?
            if not overwrite:
                raise other_settings(output, differences)
            for entry in output.iterdir():               # the folder and the (held) lock file stay
                if entry.name != LOCK_NAME:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            fmt.create_store(output, spec)
        except BaseException:
            lock.release()
            raise
        return lock
    fmt.create_store(output, spec)
    return WriterLock(output).exclusive()


def _prepare_objects(output: storage.ObjectPrefix, spec: fmt.CacheSpec, overwrite: bool) -> WriterLease:
    """:func:`prepare_store` on object storage: the lease first (``lease.py``), then the same decisions over the
    prefix's objects; replacing a store deletes its objects (all of them this project's), the lease last."""
    lock = WriterLease(output).exclusive()
    try:
        if output.is_empty(ignore=LOCK_NAME) or fmt.interrupted_creation(output):
            fmt.create_store(output, spec)
            return lock
        _refuse_foreign(output, overwrite, deep=False)
        try:
            group, on_disk = fmt.open_store(output, mode="r+")
            differences = spec.differences(on_disk)
            if group.attrs["version"] != spec.format_version:
                differences["version"] = (spec.format_version, group.attrs["version"])
        except ValueError as exc:
            differences = {"store": (f"a cache with {spec}", f"unreadable ({exc})")}
        if differences:
            _refuse_foreign(output, overwrite, deep=True)
            if not overwrite:
                raise other_settings(output, differences)
            output.delete(["zarr.json"] + [key for key in output.keys() if key not in ("zarr.json", LOCK_NAME)])
            fmt.create_store(output, spec)
    except BaseException:
        lock.release()
        raise
    return lock


def _refuse_foreign(output: pathlib.Path, overwrite: bool, *, deep: bool) -> None:
    """ValueError naming what ``output`` holds unless it is a store of this project (``format.foreign_entries``)."""
    foreign = fmt.foreign_entries(output, deep=deep)
    if foreign:
        listed = "; ".join(foreign[:3]) + (f"; and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{output} is not a cache store written by this tool ({listed}): refusing to write into"
                         f" it{' or replace it (--overwrite replaces only such stores)' if overwrite else ''};"
                         " choose another --output, or move it away yourself")


def prepare_shards(output: pathlib.Path, spec: fmt.CacheSpec, shards: range, repair: bool) -> None:
    """Checks the shards ``shards`` of a kept store (one data-parallel group's, by one of its ranks): ValueError naming
    ``--repair`` when files of written ones are missing; ``repair``: every written shard read and checked, the damaged
    ones deleted (reported on stdout), so that the shard loop rewrites them."""
    if not shards:
        return
    group = fmt.open_group(output, mode="r")
    files = fmt.ShardFiles(output, group, spec)
    if not repair:
        missing = files.missing_files(shards)
        if missing:
            raise ValueError(f"{output} is damaged: {len(missing)} files of written shards are missing "
                             f"({'; '.join(missing[:3])}); {REPAIR}")
        return
    written = files.written(shards)
    damaged = SampleReader(output, group, spec).verify(written)
    for shard, message in sorted(damaged.items()):
        begin, end = spec.shard_range(shard)
        print(f"[cache] --repair: shard {shard} (samples [{begin}, {end})) is damaged: {message}", flush=True)
        files.unwrite(shard)
    print(f"[cache] --repair: {len(damaged)} of {len(written)} written shards of samples "
          f"[{spec.shard_range(shards.start)[0]}, {spec.shard_range(shards.stop - 1)[1]}) damaged"
          f"{', rewriting them' if damaged else ''}", flush=True)


def share_summary(source: TokenWindows) -> None:
    """Computes the source's :attr:`~sources.token_windows.TokenWindows.summary` (fingerprint and token range: one pass
    over its files) on global rank 0 only, and hands it to every other rank (a failure raised on all ranks)."""
    summary = _agreed(lambda: source.summary)
    if _world()[1] > 1:
        box = [summary]
        dist.broadcast_object_list(box, src=0)
        source.summary = box[0]


def check_vocab(source: TokenWindows, vocab_size: int) -> None:
    """The data's tokenizer and token ids must fit the teacher's vocabulary (call :func:`share_summary` first
    where several ranks hold the source)."""
    if source.tokenizer_vocab_size is not None and source.tokenizer_vocab_size > vocab_size:
        raise ValueError(f"tokenizer {source.tokenizer!r} has {source.tokenizer_vocab_size} ids but the teacher's "
                         f"vocabulary has {vocab_size}: data and teacher do not match")
    low, top = source.token_range()
    if low < 0 or top >= vocab_size:
        raise ValueError(f"{source.name}: the data contain the token id {low if low < 0 else top}, outside the "
                         f"teacher's vocabulary [0, {vocab_size}): data tokenized for another vocabulary?")


def teacher_rows(output: TeacherOutput | torch.Tensor, spec: fmt.CacheSpec, *, first_sample: int, tp_group,
                 labels: torch.Tensor | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, cp_group=None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({array name: ``[s, b, ...]`` rows}, finite ``[s, b]``) of one micro-batch of teacher output (a
    ``teacher_head.TeacherOutput`` or logits ``[s, b, V/tp]``) whose first sample is ``first_sample``, through the fused
    head in blocks of ``chunk_bytes``: the rows of the store's kind (``kinds.StoreKind.teacher_rows``) and, for a
    cross-tokenizer store, the log-prob of each token's realised next token ``labels`` ``[s, b]``. With a
    ``cp_group`` of size > 1, ``output`` is this CP rank's slice ``[s/cp, b]`` (``teacher_context_parallel.py``): its rows are
    computed there and reassembled in position order on every rank."""
    kind = spec.kind
    cp = cp_size_of(cp_group)
    output = teacher_output(output)
    spans = rank_chunks(output.tokens[0] * cp, cp, dist.get_rank(cp_group) if cp > 1 else 0)

    def block_rows(logits, block):
        rows, finite = kind.teacher_rows(logits, spec, block=block, tp_group=tp_group)
        if spec.cross_tokenizer:
            p, n = logits.shape[:2]
            sample = block.first_sample - first_sample
            block_labels = labels[block.first_position:block.first_position + p, sample:sample + n]
            rows[fmt.REALISED_LOGPROB] = vocab_parallel_label_logprobs(logits, block_labels, rows[fmt.LOGSUMEXP],
                                                                       temperature=spec.temperature,
                                                                       tp_group=tp_group)
        return rows, finite

    rows, finite = head_rows(output, block_rows, first_sample=first_sample,
                             work_bytes_per_logit=kind.work_bytes_per_logit, chunk_bytes=chunk_bytes, spans=spans)
    return gather_rows(rows, finite, cp_group)


def compute_shard(windows: np.ndarray, row_masks: tuple[np.ndarray, np.ndarray], teacher_fn: TeacherFn,
                  spec: fmt.CacheSpec, *, first_sample: int, micro_batch_size: int, tp_group, stats: WriteStats,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, cp_group=None) -> dict[str, np.ndarray]:
    """The arrays of one shard from its token windows ``[P, S+1]`` and their ``row_masks`` (loss_mask uint8 ``[P, S]``,
    position_ids int32 ``[P, S]``; the row source's), the teacher's ids sorted ascending per row, each filled in
    place micro-batch by micro-batch (the shard's rows are held once, in their stored dtypes); the row masks are
    stored where the store's schema holds them, and there the tokens of loss mask 0 get padding slots
    (:func:`pad_unread_tokens`). ``chunk_bytes``: the fused head's block budget
    (:func:`teacher_rows`); ``cp_group``: the teacher's context-parallel group (``teacher_fn`` gives this rank's
    slice, the rows are whole on every rank)."""
    stored_masks = dict(zip((fmt.LOSS_MASK, fmt.POSITION_IDS), row_masks))
    names = [name for name in fmt.sample_arrays(spec) if name not in (fmt.TOKENS, fmt.RECORDS, *stored_masks)]
    dtypes = {fmt.IDS: np.int32, fmt.LOGPROBS: spec.logprob_dtype, fmt.REALISED_LOGPROB: spec.realised_codec.dtype}
    out: dict[str, np.ndarray] = {}
    tokens, positions = torch.from_numpy(windows), torch.from_numpy(row_masks[1]).long()
    for start in range(0, len(windows), micro_batch_size):
        batch = tokens[start:start + micro_batch_size, :-1]                     # [b, s]
        begin = time.perf_counter()
        with torch.no_grad():
            output = teacher_fn(batch, positions[start:start + micro_batch_size])  # hidden [s, b, H] + lm_head shard
        stats.forward_seconds += time.perf_counter() - begin
        if output is None:          # a pipeline stage before the last: it holds no logits and writes nothing
            stats.tokens += batch.numel()
            continue
        with torch.no_grad():
            rows, finite = teacher_rows(output, spec, first_sample=first_sample + start, tp_group=tp_group,
                                        labels=tokens[start:start + micro_batch_size, 1:].t(),
                                        chunk_bytes=chunk_bytes, cp_group=cp_group)
        if not bool(finite.all()):
            position, row = (~finite).nonzero()[0].tolist()
            raise ValueError(f"the teacher's logits are not finite (NaN/inf) for sample {first_sample + start + row}"
                             f", position {position} (predicting token {position + 1} of the window)")
        for name in names:
            values = rows[name].transpose(0, 1).cpu().numpy()                    # [b, s, ...]
            if name not in out:
                out[name] = np.empty((len(windows),) + values.shape[1:], dtype=dtypes.get(name, np.float32))
            out[name][start:start + len(values)] = values
        stats.tokens += batch.numel()
    if not out:
        return {}
    schema = fmt.sample_arrays(spec)
    if fmt.LOSS_MASK in schema:
        pad_unread_tokens(out, row_masks[0])
    return {fmt.TOKENS: windows.astype(np.int32)} | {name: values for name, values in stored_masks.items()
                                                     if name in schema} | out


def pad_unread_tokens(arrays: dict[str, np.ndarray], loss_mask: np.ndarray) -> None:
    """Makes the slots of every token of ``loss_mask`` 0 (uint8 ``[P, S]``) padding in place: ``arrays``' ids
    ``[P, S, K]`` 0 and log-probs ``[P, S, K]`` −inf (a row still sorted ascending; the grid codec's pad code, a
    run of repeats for the byte codecs), so a token the loss does not read costs next to no bytes. Every kind's rows
    read such a token as no slot at all: a top-K or top-p slot of probability 0, a draw of weight 0
    (``draws.draw_weights``, ``head_draws.head_draw_weights``); its per-token arrays (log-sum-exp, G) stay the
    teacher's."""
    unread = loss_mask == 0
    arrays[fmt.IDS][unread] = 0
    arrays[fmt.LOGPROBS][unread] = -np.inf


def store_shard(group: zarr.Group, spec: fmt.CacheSpec, shard: int, arrays: dict[str, np.ndarray],
                output=None) -> None:
    """The shard's data first, then its records (bound to the chunks just written), which mark it written
    (``format.ShardFiles``); ``output``: the store's place (default: the local folder of ``group``)."""
    begin, end = spec.shard_range(shard)
    for name, values in arrays.items():
        group[name][begin:end] = values
    output = group.store.root if output is None else output
    group[fmt.RECORDS][begin:end] = shard_records(output, group, spec, shard)


def write_shard(group: zarr.Group, spec: fmt.CacheSpec, shard: int, arrays: dict[str, np.ndarray],
                output=None) -> None:
    """:func:`store_shard`; a full disk leaves the shard unmarked and says what to do."""
    try:
        store_shard(group, spec, shard, arrays, output)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            begin, end = spec.shard_range(shard)
            raise OSError(errno.ENOSPC, f"disk full while writing shard {shard} (samples [{begin}, {end})) of "
                          f"{group.store}; the store stays incomplete (readers refuse it): free space and rerun "
                          "the same command to resume") from exc
        raise


def owned_shards(num_shards: int, dp_rank: int, dp_size: int) -> range:
    """The contiguous block of shards data-parallel rank ``dp_rank`` owns."""
    per, extra = divmod(num_shards, dp_size)
    begin = dp_rank * per + min(dp_rank, extra)
    return range(begin, begin + per + (dp_rank < extra))


def finish(output: pathlib.Path, spec: fmt.CacheSpec, lock=None, packing: dict | None = None) -> None:
    """Marks the store complete (one atomic attribute rewrite, which also records the row source's ``packing``
    statistics when it has any), after checking that every shard is written and that this run still holds the
    writers' ``lock``; deletes the temporaries killed runs left (every writer of this run is done)."""
    if lock is not None:
        lock.check()
    group = fmt.open_group(output, mode="r+")
    missing = fmt.ShardFiles(output, group, spec).missing_samples()
    if missing:
        raise ValueError(f"cannot finish {output}: samples {fmt.describe_ranges(missing)} are not written")
    fmt.remove_partials(output)
    group.attrs.update(complete=True, **({"packing": packing} if packing else {}))


def describe_packing(packing: dict) -> str:
    """One line of a row source's packing statistics (``{"documents": n, "efficiency": tokens / slots, ...}``)."""
    named = {"documents": lambda n: f"{n} documents",
             "efficiency": lambda e: f"packing efficiency {e:.1%} (document tokens / row slots)"}
    keys = [key for key in named if key in packing] + [key for key in packing if key not in named]
    return ", ".join(named[key](packing[key]) if key in named else f"{key} {packing[key]}" for key in keys)


def _prepare_shared(output: pathlib.Path, spec: fmt.CacheSpec, overwrite: bool, repair: bool,
                    vocab_table=None) -> WriterLock:
    """:func:`prepare_store` under the exclusive lock, which then turns shared (atomically: no run slips in); a
    cross-tokenizer store gets the teacher's byte table (``vocab_table``, a ``token_bytes.TokenBytes``) first; a
    repair marks the store incomplete until it finishes (its damaged shards are deleted next)."""
    lock = prepare_store(output, spec, overwrite)
    try:
        group = fmt.open_group(output, mode="r+")
        if vocab_table is not None:
            group[fmt.VOCAB_OFFSETS][:] = vocab_table.offsets
            group[fmt.VOCAB_BYTES][:] = vocab_table.bytes
        if repair and group.attrs.get("complete"):
            group.attrs.update(complete=False)
    except BaseException:
        lock.release()
        raise
    return lock.shared()


def _join_shared(output: pathlib.Path, lock: WriterLock | None) -> WriterLock:
    """Rank 0's shared lock; every other rank takes its own (after rank 0's turned shared)."""
    return lock if lock is not None else writer_lock(output, exclusive=False)


def _preparer(dp_rank: int) -> bool:
    """Whether this rank is the lowest global rank of its data-parallel group (the ranks that share ``dp_rank``):
    the one that checks and repairs the group's shards."""
    rank, world = _world()
    if world == 1:
        return True
    dp_ranks = [None] * world
    dist.all_gather_object(dp_ranks, dp_rank)
    return dp_ranks.index(dp_rank) == rank


def _write_shards(output: pathlib.Path, spec: fmt.CacheSpec, source: TokenWindows, teacher_fn: TeacherFn, *,
                  micro_batch_size: int, tp_group, dp_size: int, shards: range, progress: bool,
                  on_shard_written: Callable[[int], None], chunk_bytes: int, cp_group,
                  lock: WriterLock | WriterLease) -> WriteStats:
    """Computes the shards of ``shards`` not yet written and, on TP and CP rank 0 of the last pipeline stage, writes
    them, each once this rank's handle of the writers' ``lock`` says the run still holds it (``lock.check``)."""
    group = fmt.open_group(output, mode="r+")
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    writes = tp_rank == 0 and (cp_size_of(cp_group) == 1 or dist.get_rank(cp_group) == 0)
    stats = WriteStats()
    written = set(fmt.ShardFiles(output, group, spec).written(shards))
    todo = [shard for shard in shards if shard not in written]
    stats.shards_skipped = len(shards) - len(todo)
    show = progress and _world()[0] == 0
    from tqdm import tqdm

    bar = tqdm(total=sum(end - begin for begin, end in map(spec.shard_range, todo)) * spec.seq_length,
               unit="tok", unit_scale=True, desc=f"caching (DP rank 0 of {dp_size})", disable=not show)
    loop_start = time.perf_counter()
    on_shard_written(stats.shards_written)
    def written(tokens: int) -> None:
        stats.shards_written += 1
        bar.update(tokens)
        on_shard_written(stats.shards_written)

    # on object storage a shard's PUTs overlap the next shard's computation (one shard in flight; a shard counts as
    # written, and ``on_shard_written`` hears of it, once its records are stored)
    uploads = concurrent.futures.ThreadPoolExecutor(1) if writes and isinstance(output, storage.ObjectPrefix) else None
    in_flight = None
    try:
        for shard in todo:
            begin, end = spec.shard_range(shard)
            arrays = compute_shard(source.windows(begin, end), source.row_masks(begin, end), teacher_fn, spec,
                                   first_sample=begin,
                                   micro_batch_size=micro_batch_size, tp_group=tp_group, stats=stats,
                                   chunk_bytes=chunk_bytes, cp_group=cp_group)
            if in_flight is not None:
                in_flight[0].result()
                written(in_flight[1])
                in_flight = None
            tokens = (end - begin) * spec.seq_length
            if writes and arrays:
                lock.check()                            # a run that lost its lease writes no further shard
            if uploads is not None and arrays:
                in_flight = (uploads.submit(write_shard, group, spec, shard, arrays, output), tokens)
                continue
            if writes and arrays:
                write_shard(group, spec, shard, arrays, output)
            written(tokens)
        if in_flight is not None:
            in_flight[0].result()
            written(in_flight[1])
    finally:
        if uploads is not None:
            uploads.shutdown(wait=True)
    stats.total_seconds = time.perf_counter() - loop_start
    bar.close()
    return stats


def refuse_while_written(output) -> None:
    """ValueError on every rank while another run holds the writers' lock of the store at ``output``: the cache
    command asks before it loads the teacher (minutes for a large one); ``write_cache`` takes the lock for real."""
    output = fmt.store_location(output)
    if isinstance(output, storage.ObjectPrefix):
        _agreed(WriterLease(output).probe)
        return
    lock_file = output / LOCK_NAME
    _agreed(lambda: lock_file.is_file() and WriterLock(output).exclusive().release())


def write_cache(source: TokenWindows, teacher_fn: TeacherFn, output, *, k: int, vocab_size: int, teacher: str,
                temperature: float = 1.0, logprob_codec: str | None = None,
                samples_per_shard: int | None = None, store_logsumexp: bool = False, micro_batch_size: int = 1,
                mode: str = "topk", proposal_temperature: float = 1.0, sample_seed: int = 0, overwrite: bool = False,
                repair: bool = False, tp_group=None, dp_rank: int = 0, dp_size: int = 1,
                progress: bool = True, after_shards: Callable[[], None] | None = None,
                on_shard_written: Callable[[int], None] = lambda shards_written: None,
                vocab_table=None, head_chunk_bytes: int = DEFAULT_CHUNK_BYTES, cp_group=None,
                **kind_fields) -> WriteStats:
    """Writes (or resumes) the store at ``output``; call on every rank with the same arguments.

    ``source``: a row source (``TokenWindows`` or a documents layout's rows: ``windows``, ``row_masks``, ``layout``,
    ``packing``); its layout is recorded in the store, its loss mask and positions stored where the format holds
    them (``format.py``), its packing statistics recorded when the store is finished (the cache command prints them:
    :func:`describe_packing`).

    ``mode="sampled"`` writes ``k`` draws per token from q ∝ p^(1/proposal_temperature) (see ``format.py``);
    ``kind_fields`` are the ``format.CacheSpec`` fields of the other kinds of store (``kinds/``: ``top_p`` and
    ``min_k`` for a top-p store, ``head`` for a head + draws store).
    ``vocab_table`` (the teacher tokenizer's ``token_bytes.TokenBytes``, ``vocab_size`` ids) makes a cross-tokenizer
    store: it also holds the byte table and each token's realised log-prob (``format.py``). ``head_chunk_bytes``: the
    fused head's block budget (``teacher_head.py``; the rows do not depend on it). ``cp_group``: the teacher's
    context-parallel group (``teacher_context_parallel.py``; ``teacher_fn`` gives each CP rank its slice).

    ``teacher_fn`` runs the teacher (see :data:`TeacherFn`); ``tp_group`` is its tensor-parallel group (None: no
    TP); it may return None on ranks that hold no logits (pipeline stages before the last), which then write
    nothing. ``repair``: check every written shard and rewrite the damaged ones (see the module docstring).
    ``after_shards`` runs on every rank after its last shard, before the closing barrier (e.g. the dummy forwards that
    keep a MoE teacher's expert-parallel ranks in step). ``on_shard_written`` is called on every rank with the number of
    shards it has written in this run, once the store is prepared (0) and after each shard (the kill test stops its
    workers there, at known shard boundaries). Returns this rank's :class:`WriteStats`. Raises ValueError on non-finite
    logits (naming the sample and position), on data that do not fit the vocabulary, on a store with other settings at
    ``output`` (without ``overwrite``), on anything at ``output`` that is not a store of this project, and while another
    run writes the store; OSError naming ``output`` when it cannot be created or the disk fills. """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    check_cp_seq_length(source.seq_length, cp_size_of(cp_group))
    output = fmt.store_location(output)
    share_summary(source)
    spec = fmt.CacheSpec(k=k, vocab_size=vocab_size, seq_length=source.seq_length, num_samples=len(source),
                         layout=source.layout,
                         temperature=temperature, teacher=teacher, tokenizer=source.tokenizer,
                         fingerprint=source.fingerprint, logprob_codec=logprob_codec,
                         samples_per_shard=samples_per_shard, store_logsumexp=store_logsumexp, mode=mode,
                         proposal_temperature=proposal_temperature, sample_seed=sample_seed,
                         vocab_bytes=0 if vocab_table is None else len(vocab_table.bytes), **kind_fields)
    fmt.check_logprob_codec(spec.kind, spec.logprob_codec)
    check_vocab(source, vocab_size)
    if vocab_table is not None and len(vocab_table.offsets) != vocab_size + 1:
        raise ValueError(f"the teacher tokenizer's byte table covers {len(vocab_table.offsets) - 1} ids, the teacher's "
                         f"vocabulary {vocab_size}")
    lock = _agreed(_prepare_shared, output, spec, overwrite, repair, vocab_table)
    lock = _agreed(_join_shared, output, lock, everywhere=True)
    try:
        shards = owned_shards(spec.num_shards, dp_rank, dp_size)
        preparer = _preparer(dp_rank)
        _agreed(lambda: preparer and prepare_shards(output, spec, shards, repair), everywhere=True)
        stats = _write_shards(output, spec, source, teacher_fn, micro_batch_size=micro_batch_size,
                              tp_group=tp_group, dp_size=dp_size, shards=shards, progress=progress,
                              on_shard_written=on_shard_written, chunk_bytes=head_chunk_bytes, cp_group=cp_group,
                              lock=lock)
        if after_shards is not None:
            after_shards()
        _barrier()
        _agreed(finish, output, spec, lock, source.packing)
        _barrier()
    finally:
        lock.release()
    return stats
