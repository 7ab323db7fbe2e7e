"""Megatron-Bridge dataset provider over a teacher top-K cache (``cfg.dataset`` of a KD run).

    cfg.dataset = TopKCacheDatasetProvider(cache_path="cache.zarr", seq_length=4096)

Bridge calls ``build_datasets(context)`` during setup with the sample counts its samplers will draw; every split is
a ``TopKCacheDataset`` (rows are a pure function of (seed, row), so resuming at ``consumed_samples`` keeps rows
aligned). The store is checked before step one: finished, K as expected, its seq_length a multiple of the
student's (and, through ``check_kd_config``, its vocabulary inside the student's).

With ``student_tokenizer`` (a tokenizer.json, or the student's HF tokenizer / checkpoint folder) of another identity
than the store's tokenizer, every split is a ``CrossTokenizerDataset`` instead (issue #18): each cached sample is
re-tokenised by the student and cut at a chunk boundary to ``seq_length``; the store must be a cross-tokenizer one
(``cache --cross-tokenizer``). The alignments are computed once per store and student tokenizer and kept in a
memory-mapped sidecar folder beside the store (``student_alignments``).
"""

from __future__ import annotations

import dataclasses
import warnings

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
import numpy as np

from megatron_kd_plugin.bridge.dataset import CrossTokenizerDataset, TopKCacheDataset
from megatron_kd_plugin.cache import TopKCacheReader


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
    ``CrossTokenizerDataset``; seq_length need not divide the cache's). None, or the store's own tokenizer: the
    teacher's tokens and top-K as they are."""

    student_alignments: str = "sidecar"
    """Cross-tokenizer rows: where each cached sample's student tokenization and chunks come from
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

    def student_table(self, reader: TopKCacheReader, vocab_size: int | None = None):
        """The student tokenizer's ``TokenBytes`` when the rows are cross-tokenizer ones (``student_tokenizer`` of
        another identity than the store's tokenizer), else None; ValueError for a missing tokenizer file, a student
        tokenizer larger than ``vocab_size``, or a store without the cross-tokenizer arrays."""
        if self.student_tokenizer is None:
            return None
        from megatron_kd_plugin.cache import TokenBytes

        student = TokenBytes.load(self.student_tokenizer)
        if student.identity == reader.spec.tokenizer:
            return None
        reader.vocab_table()                        # refuses a store without the arrays, naming the cache option
        if vocab_size is not None and len(student.strings) > vocab_size:
            raise ValueError(f"dataset.student_tokenizer={self.student_tokenizer} has {len(student.strings)} ids, more "
                             f"than the student's vocab_size={vocab_size}")
        return student

    def open_validated(self, *, vocab_size: int | None = None) -> TopKCacheReader:
        """Open the store and check it against this provider and the student's ``vocab_size`` (if given: every
        teacher id, or with a cross-tokenizer student every student id, must lie below it); ValueError if not.
        ``check_kd_config`` passes the model's."""
        reader = TopKCacheReader(self.cache_path)   # refuses an unfinished store
        if self.student_table(reader, vocab_size) is not None:
            reader.validate(k=self.k)
        else:
            reader.validate(vocab_size=vocab_size, seq_length=self.seq_length, k=self.k)
        return reader

    def alignments(self, reader: TopKCacheReader, student):
        """The ``StudentAlignments`` the splits share (``student_alignments``)."""
        from megatron_kd_plugin.cache import StudentAlignments, load_or_write, sidecar_path

        alignments = StudentAlignments(reader, student)
        if self.student_alignments == "sidecar":
            path = sidecar_path(reader, student)
            try:
                load_or_write(alignments, path)
            except OSError as error:                 # a read-only folder or file system
                warnings.warn(f"{path}: not written ({error}); the student alignments are computed on first use and "
                              "kept in memory", stacklevel=2)
        return alignments

    def build_datasets(self, context: DatasetBuildContext):
        """(train, valid, test) ``TopKCacheDataset``s with the sample counts Bridge asks for (None if 0)."""
        reader = self.open_validated()
        student = self.student_table(reader)
        bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        n = reader.spec.num_samples
        counts = (context.train_samples, context.valid_samples, context.test_samples)
        alignments = None if student is None else self.alignments(reader, student)
        datasets = []
        for index, (bound, rows) in enumerate(zip(bounds, counts)):
            if bound is None or not rows:
                datasets.append(None)
                continue
            sample_ids = np.arange(int(round(bound[0] * n)), int(round(bound[1] * n)))
            if index and len(sample_ids) == 0:
                datasets.append(None)   # an empty eval split: Bridge then skips evaluation
                continue
            if student is not None:
                datasets.append(CrossTokenizerDataset(reader, sample_ids, student=student, seq_length=self.seq_length,
                                                      num_rows=rows, seed=self.seed + index, shuffle=self.shuffle,
                                                      alignments=alignments))
                continue
            datasets.append(TopKCacheDataset(reader, sample_ids, seq_length=self.seq_length, num_rows=rows,
                                             seed=self.seed + index, shuffle=self.shuffle))
        return tuple(datasets)
