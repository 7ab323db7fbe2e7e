"""Student training rows cut from a teacher top-K cache: a map-style dataset Megatron's samplers can index.

A cached sample holds S_c tokens; a student with seq_length S (S divides S_c) sees S_c / S windows per cached
sample. Window w of cached sample i gives the row

    tokens           = cache.tokens[i][w*S : w*S + S]            # [S]
    labels           = cache.tokens[i][w*S + 1 : w*S + S + 1]    # [S], the token each position predicts
    teacher_ids      = cache.teacher_ids[i][w*S : w*S + S]       # [S, K], the teacher's top-K for those labels
    teacher_logprobs = cache.teacher_logprobs[i][w*S : w*S + S]  # [S, K]
    teacher_sample_weights = the reader's importance weights   # [S, K], sampled stores only
    loss_mask        = 1, position_ids = 0..S-1                  # [S]

Rows are windows of a split's cached samples visited epoch after epoch, each epoch in its own permutation drawn
from (seed, epoch): row j is a pure function of (seed, j), so a run resumed at ``consumed_samples`` by Megatron's
samplers continues on exactly the rows it would have seen, and any DP size / batch size reads the same sequence.

``CrossTokenizerDataset`` (issue #18): a student with its own tokenizer; each cached sample gives one row, its text
re-tokenised by the student and aligned into chunks (``megatron_kd_plugin.cache.align``), with ``chunk_ids`` and
``teacher_chunk_logprobs``, and the pair arrays (the sample's top-K mapped to the student's ids and each position's
pair, ``align.PAIR_KEYS``; not for a sampled store); each sample's alignment is computed once
(``cache.student_alignments``), so a later read costs the sample's realised log-probs and top-K and the cut.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_kd_plugin.cache import SAMPLE_WEIGHTS, StudentAlignments


class TopKCacheDataset(torch.utils.data.Dataset):
    """``num_rows`` student rows of ``seq_length`` tokens drawn from the cached samples ``sample_ids``."""

    def __init__(self, reader, sample_ids: np.ndarray, *, seq_length: int, num_rows: int, seed: int,
                 shuffle: bool = True):
        if len(sample_ids) == 0:
            raise ValueError("this split holds no cached samples; change the split or write a larger cache")
        self.reader = reader
        self.sample_ids = np.asarray(sample_ids, dtype=np.int64)
        self.seq_length = seq_length
        self.windows_per_sample = self._windows_per_sample(reader, seq_length)
        self.windows_per_epoch = len(self.sample_ids) * self.windows_per_sample
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self._epoch, self._order = -1, None

    @staticmethod
    def _windows_per_sample(reader, seq_length: int) -> int:
        reader.validate(seq_length=seq_length)
        return reader.spec.seq_length // seq_length

    def __len__(self) -> int:
        return self.num_rows

    def window_of(self, row: int) -> tuple[int, int]:
        """(cached sample index, window index) that row ``row`` reads."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range for a dataset of {self.num_rows} rows")
        epoch, position = divmod(row, self.windows_per_epoch)
        if self.shuffle and epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.windows_per_epoch)
            self._epoch = epoch
        window = int(self._order[position]) if self.shuffle else position
        sample, offset = divmod(window, self.windows_per_sample)
        return int(self.sample_ids[sample]), offset

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        sample, window = self.window_of(int(row))
        cached = self.reader.window(sample * self.windows_per_sample + window, self.seq_length)
        tokens = cached["tokens"]                                       # [S + 1]
        weights = {SAMPLE_WEIGHTS: cached[SAMPLE_WEIGHTS]} if SAMPLE_WEIGHTS in cached else {}   # [S, K]
        return weights | {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
            "teacher_ids": cached["teacher_ids"],                       # [S, K]
            "teacher_logprobs": cached["teacher_logprobs"],             # [S, K]
        }


class CrossTokenizerDataset(TopKCacheDataset):
    """``num_rows`` rows of a student whose tokenizer (``student``, a ``token_bytes.TokenBytes``) differs from the
    teacher's: one row of ``seq_length`` student tokens per cached sample (``align.alignment_row``). Each sample's
    alignment is computed once and kept (``alignments``: a ``StudentAlignments`` of this reader and student, perhaps
    prepared or loaded from its sidecar; default: a new one, filled on first use)."""

    def __init__(self, reader, sample_ids: np.ndarray, *, student, seq_length: int, num_rows: int, seed: int,
                 shuffle: bool = True, alignments: StudentAlignments | None = None):
        self.alignments = StudentAlignments(reader, student) if alignments is None else alignments
        super().__init__(reader, sample_ids, seq_length=seq_length, num_rows=num_rows, seed=seed, shuffle=shuffle)

    @staticmethod
    def _windows_per_sample(reader, seq_length: int) -> int:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length}: expected >= 1")
        return 1

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        sample, _ = self.window_of(int(row))
        return self.alignments.row(sample, self.seq_length)
