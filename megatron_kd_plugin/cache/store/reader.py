"""Random access to a finished teacher top-K store (format: ``format.py``), as torch tensors.

``reader[i]`` is sample i, a :class:`CachedSample`: its tokens ``[S+1]`` and its teacher ``[S, K]`` in the store
kind's type (``kinds.StoreKind.teacher``): a ``TopKTeacher`` (ids sorted ascending per row, log-probs) or, for
draws (K = N), a ``SampledTeacher`` whose importance weights w = (1/N)·p/q the kind computes from the stored l (and
G when t != 1); with the teacher's full-vocab logsumexp ``[S]`` when stored, and the row's loss mask and positions
``[S]`` (stored in documents stores; all ones and 0..S-1 in stream stores, ``format.py``).
A cross-tokenizer store's samples also carry the realised log-prob ``[S]`` and ``reader.vocab_table()`` is the teacher
tokenizer's byte table (``token_bytes.TokenBytes``). A student's training rows are read by the store's kind of rows
(``rows/kd_rows.py``). Opening refuses an unfinished store and one whose metadata do not match its attributes
(``format.open_store``); ``validate`` checks the store against what the student expects; both raise ValueError saying
what is wrong. Every read checks the CRC32C of the shard index and of the chunk (``chunk_reader.py``), the chunk's
record binding it to its array, sample and store, and that its ids lie in the vocabulary (``records.py``): damage, or a
store replaced since the reader opened it, raises ``chunk_reader.DamagedStoreError`` (a ValueError) naming the file and
the samples, never returns wrong rows.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.read_ahead import ReadAhead
from megatron_kd_plugin.cache.store.records import SampleReader
from megatron_kd_plugin.loss import SampledTeacher, TopKTeacher


class CachedSample(NamedTuple):
    """One cached sample as ``reader[i]`` returns it (module docstring)."""

    tokens: torch.Tensor                     # [S+1] int64
    teacher: TopKTeacher | SampledTeacher    # [S, K]: ids int64, log-probs (and weights) float32
    logsumexp: torch.Tensor | None           # [S] float32 the teacher's full-vocab logsumexp; None: not stored
    realised_logprob: torch.Tensor | None    # [S] float32 log-prob of each realised token; None: not stored
    loss_mask: torch.Tensor                  # [S] uint8: 1 where the label tokens[t+1] is a loss target
    position_ids: torch.Tensor               # [S] int64: restart at 0 at every document (stream: 0..S-1)


_WORKERS = ("a store on object storage is read by the training process itself (its read-ahead threads do not "
            "survive a fork, its client not a pickle): set dataset.num_workers=0")


class TopKCacheReader:
    """Reads a complete store; cheap to construct (it reads only metadata)."""

    def __init__(self, path):
        self.path = fmt.store_location(path)
        group, self.spec = fmt.open_finished_store(self.path)
        self.group = group
        self._samples = SampleReader(self.path, group, self.spec)     # every per-sample array of the store
        self._ahead = ReadAhead(self._samples) if isinstance(self.path, storage.ObjectPrefix) else None
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.spec.num_samples

    def validate(self, *, vocab_size: int | None = None, seq_length: int | None = None, k: int | None = None,
                 fingerprint: str | None = None, tokenizer: str | None = None, mode: str | None = None) -> None:
        """ValueError unless the store fits a student with these settings (None: not checked).

        vocab_size: the student's (padded) vocabulary; the teacher's must not be larger. seq_length: must
        divide the cached one, and equal it in a documents store (its rows are read whole: a window of a packed
        row would cut its documents). k, fingerprint, tokenizer, mode: must equal the store's.
        """
        spec = self.spec
        if vocab_size is not None and spec.vocab_size > vocab_size:
            raise ValueError(f"{self.path}: the teacher vocabulary ({spec.vocab_size} ids, tokenizer "
                             f"{spec.tokenizer!r}) is larger than the student's vocab_size={vocab_size}")
        if seq_length is not None and spec.documents and seq_length != spec.seq_length:
            raise ValueError(f"{self.path}: student seq_length={seq_length}, but the store holds {spec.layout} rows "
                             f"of seq_length={spec.seq_length}, read whole (shorter windows would cut documents); "
                             f"set model.seq_length and dataset.seq_length to {spec.seq_length}, or cache the "
                             f"store with --seq-length {seq_length}")
        if seq_length is not None and (seq_length < 1 or spec.seq_length % seq_length):
            raise ValueError(f"{self.path}: student seq_length={seq_length} does not divide the cached "
                             f"seq_length={spec.seq_length}")
        for name, value in (("k", k), ("fingerprint", fingerprint), ("tokenizer", tokenizer), ("mode", mode)):
            if value is not None and value != getattr(spec, name):
                raise ValueError(f"{self.path}: {name}={value!r} requested, the store has {getattr(spec, name)!r}")

    def _check_index(self, index: int, size: int) -> int:
        index = int(index)
        if not -size <= index < size:
            raise IndexError(f"index {index} out of range for {size} entries")
        return index % size

    def sample_arrays(self, sample: int, names=None) -> dict[str, np.ndarray]:
        """The stored arrays of ``sample`` (``names``: only those) as numpy, in their on-disk dtypes (one chunk
        each), checked."""
        if self._ahead is None:
            return self._samples.read(sample, names)
        self._refuse_other_process()
        return self._ahead.read(sample, names)

    def hint(self, samples) -> None:
        """The samples to be read next, in order: fetched ahead on object storage (``read_ahead.py``); nothing on
        a local disk (the page cache reads ahead)."""
        if self._ahead is not None:
            self._refuse_other_process()
            self._ahead.hint(samples)

    def _refuse_other_process(self) -> None:
        if os.getpid() != self._pid:
            raise ValueError(_WORKERS)

    def __getstate__(self):
        if self._ahead is not None:
            raise ValueError(_WORKERS)
        return self.__dict__

    def vocab_table(self):
        """The teacher tokenizer's byte table of a cross-tokenizer store (``token_bytes.TokenBytes``); ValueError
        naming the cache option that writes it when the store lacks it, or when it is damaged."""
        from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes

        if not self.spec.cross_tokenizer:
            raise ValueError(f"{self.path} holds no cross-tokenizer arrays (the teacher's realised log-probs and byte "
                             "table): a student with another tokenizer needs a store written by "
                             "`python -m megatron_kd_plugin cache ... --cross-tokenizer`")
        offsets, table = self.group[fmt.VOCAB_OFFSETS], self.group[fmt.VOCAB_BYTES]
        if offsets.nchunks_initialized != offsets.nchunks or table.nchunks_initialized != table.nchunks:
            raise ValueError(f"{self.path}: the teacher's byte table ({fmt.VOCAB_OFFSETS}, {fmt.VOCAB_BYTES}) is not "
                             "stored (the store is damaged; rewrite it with the same cache command plus --overwrite)")
        offsets, table = offsets[:], table[:]
        if offsets[0] != 0 or offsets[-1] != len(table) or np.any(np.diff(offsets) < 0):
            raise ValueError(f"{self.path}: the teacher's byte table offsets are damaged")
        return TokenBytes.from_arrays(table, offsets, identity=self.spec.tokenizer)

    def __getitem__(self, index: int) -> CachedSample:
        """Sample ``index`` (module docstring)."""
        arrays = self.sample_arrays(self._check_index(index, len(self)))
        rows = {fmt.IDS: torch.from_numpy(arrays[fmt.IDS].astype(np.int64)),
                fmt.LOGPROBS: torch.from_numpy(arrays[fmt.LOGPROBS].astype(np.float32))}
        rows |= {name: torch.from_numpy(arrays[name].copy()) for name in self.spec.kind.token_arrays(self.spec)}
        optional = [torch.from_numpy(arrays[name].astype(np.float32)) if name in arrays else None
                    for name in (fmt.LOGSUMEXP, fmt.REALISED_LOGPROB)]
        return CachedSample(torch.from_numpy(arrays[fmt.TOKENS].astype(np.int64)),
                            self.spec.kind.teacher(self.spec, rows), *optional, *self._row_masks(arrays))

    def _row_masks(self, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_mask uint8 ``[S]``, position_ids int64 ``[S]``) of a sample's ``arrays``: the stored ones of a
        documents store, all ones and 0..S-1 for a stream store (every store of format version 5 or earlier)."""
        s = self.spec.seq_length
        if fmt.LOSS_MASK not in arrays:
            return torch.ones(s, dtype=torch.uint8), torch.arange(s)
        return (torch.from_numpy(arrays[fmt.LOSS_MASK].copy()),
                torch.from_numpy(arrays[fmt.POSITION_IDS].astype(np.int64)))
