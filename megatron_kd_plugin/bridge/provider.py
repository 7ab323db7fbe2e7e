"""Megatron-Bridge dataset provider over a teacher top-K cache (``cfg.dataset`` of a KD run).

    cfg.dataset = TopKCacheDatasetProvider(cache_path="cache.zarr", seq_length=4096)

Bridge calls ``build_datasets(context)`` during setup with the sample counts its samplers will draw; every split is
a ``cache.KDRows`` over the rows of the store's kind (``cache.row_kind``: top-K, sampled, or, with a
``student_tokenizer`` of another identity than the store's tokenizer, cross-tokenizer rows), so resuming at
``consumed_samples`` keeps rows aligned. The store is checked before step one (``row_kind``, through
``check_kd_config``): finished, K as expected, its ids inside the student's vocabulary, its seq_length a multiple of
the student's (cross-tokenizer rows: the student tokenizer inside the student's vocabulary).
"""

from __future__ import annotations

import dataclasses

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
import numpy as np

from megatron_kd_plugin.cache import KDRows, RowKind, TokenBytes, TopKCacheReader, row_kind


@dataclasses.dataclass(kw_only=True)
class TopKCacheDatasetProvider(DatasetProvider):
    """Train/valid/test datasets of student rows read from one teacher top-K cache store."""

    cache_path: str
    """Path of the finished cache store (written by ``megatron_kd_plugin.cache``)."""

    seq_length: int
    """Student sequence length; must divide the cache's seq_length (one cached sample = several student rows)."""

    k: int | None = None
    """Expected top-K of the store; None accepts the store's K."""

    split: str = "100,0,0"
    """Megatron-style train,valid,test weights over the cached samples (contiguous ranges, no sample shared)."""

    seed: int = 1234
    """Shuffling seed (also the seed Bridge's batch sampler reads from ``cfg.dataset.seed``)."""

    shuffle: bool = True
    """Visit each epoch's windows in a seeded random order; False: cache order."""

    dataloader_type: str | None = "single"
    """Megatron sampler: ``single`` (sequential over rows, resumable by consumed samples) or ``cyclic``."""

    student_tokenizer: str | None = None
    """The student's tokenizer (a tokenizer.json, or a folder holding one: its HF tokenizer or checkpoint folder)
    when it differs from the teacher's: the rows are then re-tokenised and aligned (cross-tokenizer distillation,
    ``cache.cross_tokenizer_rows``; seq_length need not divide the cache's). None, or the store's own tokenizer: the
    teacher's tokens and top-K as they are."""

    student_alignments: str = "sidecar"
    """Cross-tokenizer rows: where each cached sample's student tokenization and segments come from
    (``cache.student_alignments``). ``sidecar``: the folder ``<store>.align-<tokenizer hash>`` beside the store,
    memory-mapped (one copy per machine in the page cache), or, when absent or of another store/tokenizer, computed
    for the whole store (batch encode, a progress bar) before step one by the first process to take its lock, written
    there atomically while the others wait, then mapped (where the folder is read-only: computed on first use and
    kept in memory, with a warning); ``memory``: computed on each sample's first read and kept in memory."""

    def finalize(self) -> None:
        """Check the fields that need no store (Bridge calls this while validating the config)."""
        super().finalize()
        if self.seq_length < 1:
            raise ValueError(f"dataset.seq_length={self.seq_length}: expected >= 1")
        if self.k is not None and self.k < 1:
            raise ValueError(f"dataset.k={self.k}: expected >= 1 or None")
        parse_and_normalize_split(self.split)
        if self.student_alignments not in ("sidecar", "memory"):
            raise ValueError(f"dataset.student_alignments={self.student_alignments!r}: expected 'sidecar' or 'memory'")

    def row_kind(self, *, vocab_size: int | None = None) -> RowKind:
        """The store opened and its rows' kind looked up for this student, checked against this provider and the
        student's ``vocab_size`` (if given; ``check_kd_config`` passes the model's); ValueError if they do not fit."""
        reader = TopKCacheReader(self.cache_path)   # refuses an unfinished store
        student = None if self.student_tokenizer is None else TokenBytes.load(self.student_tokenizer)
        kind = row_kind(reader, seq_length=self.seq_length, student=student, alignments=self.student_alignments)
        kind.validate(vocab_size=vocab_size, k=self.k)
        return kind

    def build_datasets(self, context: DatasetBuildContext):
        """(train, valid, test) ``KDRows`` with the sample counts Bridge asks for (None if 0)."""
        kind = self.row_kind()
        kind.prepare()
        bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        n = kind.reader.spec.num_samples
        counts = (context.train_samples, context.valid_samples, context.test_samples)
        datasets = []
        for index, (bound, rows) in enumerate(zip(bounds, counts)):
            if bound is None or not rows:
                datasets.append(None)
                continue
            sample_ids = np.arange(int(round(bound[0] * n)), int(round(bound[1] * n)))
            if index and len(sample_ids) == 0:
                datasets.append(None)   # an empty eval split: Bridge then skips evaluation
                continue
            datasets.append(KDRows(kind, sample_ids, num_rows=rows, seed=self.seed + index, shuffle=self.shuffle))
        return tuple(datasets)
