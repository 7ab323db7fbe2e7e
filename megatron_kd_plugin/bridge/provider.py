"""Megatron-Bridge dataset provider over a teacher top-K cache (``cfg.dataset`` of a KD run).

    cfg.dataset = TopKCacheDatasetProvider(cache_path="cache.zarr", seq_length=4096)

Bridge calls ``build_datasets(context)`` during setup with the sample counts its samplers will draw; every split is
a ``TopKCacheDataset`` (rows are a pure function of (seed, row), so resuming at ``consumed_samples`` keeps rows
aligned). The store is checked before step one: finished, K as expected, its seq_length a multiple of the
student's (and, through ``check_kd_config``, its vocabulary inside the student's).
"""

from __future__ import annotations

import dataclasses

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
import numpy as np

from megatron_kd_plugin.bridge.dataset import TopKCacheDataset
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

    def finalize(self) -> None:
        """Check the fields that need no store (Bridge calls this while validating the config)."""
        super().finalize()
        if self.seq_length < 1:
            raise ValueError(f"dataset.seq_length={self.seq_length}: expected >= 1")
        if self.k is not None and self.k < 1:
            raise ValueError(f"dataset.k={self.k}: expected >= 1 or None")
        parse_and_normalize_split(self.split)

    def open_validated(self, *, vocab_size: int | None = None) -> TopKCacheReader:
        """Open the store and check it against this provider and the student's ``vocab_size`` (if given: every
        teacher id must lie below it); ValueError if not. ``check_kd_config`` passes the model's."""
        reader = TopKCacheReader(self.cache_path)   # refuses an unfinished store
        reader.validate(vocab_size=vocab_size, seq_length=self.seq_length, k=self.k)
        return reader

    def build_datasets(self, context: DatasetBuildContext):
        """(train, valid, test) ``TopKCacheDataset``s with the sample counts Bridge asks for (None if 0)."""
        reader = self.open_validated()
        bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        n = reader.spec.num_samples
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
            datasets.append(TopKCacheDataset(reader, sample_ids, seq_length=self.seq_length, num_rows=rows,
                                             seed=self.seed + index, shuffle=self.shuffle))
        return tuple(datasets)
