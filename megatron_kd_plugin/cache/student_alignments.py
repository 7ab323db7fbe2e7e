"""Each cached sample's student tokenization and chunks, computed once per reader, and a sidecar file of them.

A cross-tokenizer row (``align.py``) costs the student tokenizer's encode of the sample's text and the alignment
(``align.align_sample``); both depend only on the sample's teacher tokens and the two tokenizers, not on the student's
seq_length or the realised log-probs. ``StudentAlignments`` computes each sample's ``SampleAlignment`` once (on first
use, or all at once in blocks with the tokenizer's batch encode: ``prepare``) and keeps it in memory; a row then
costs one read of the sample's realised log-probs and the cut (``align.alignment_row``). Memory: ~4.5 B per student
token + 4 B per teacher token of the samples aligned so far (~11 GB for 10^9 teacher tokens).

Sidecar (``save`` / ``load``): every alignment of a store in one ``.npz`` next to the store, never inside it::

    ids [sum n] int32, student_chunks [sum n] int32, offsets [N + 1] int64 (sample i: [offsets[i], offsets[i+1])),
    teacher_chunks [N, S] int32, num_boundaries [N] int64,
    key: JSON {"format", "store_identity", "student"} (the store's identity attribute, the student tokenizer's
         SHA-256 of its ``tokenizer.json``)

written to a temporary file in the same folder and renamed over the target (atomic: concurrent writers of the same key
write the same bytes, the last rename wins, a reader never sees a partial file). ``load`` refuses a file of another
key (a rewritten store, another tokenizer) and returns False, so the caller recomputes. Default path:
``<store>.align-<student hash>.npz`` (:func:`sidecar_path`).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import tempfile
import zipfile

import numpy as np

from megatron_kd_plugin.cache import format as fmt
from megatron_kd_plugin.cache.align import (SampleAlignment, TeacherTopK, align_sample, alignment_row,
                                            identical_strings, valid_text)

SIDECAR_FORMAT = "megatron_kd_plugin.student_alignments/1"
BLOCK = 64
"""Samples per batch encode in ``prepare``."""


def store_key(reader, student) -> dict:
    """The sidecar key of ``reader``'s store and the ``student`` tokenizer (``TokenBytes``)."""
    identity = reader.group.attrs.get("identity") or fmt.store_identity(reader.spec)
    return {"format": SIDECAR_FORMAT, "store_identity": identity, "student": student.fingerprint}


def sidecar_path(reader, student) -> pathlib.Path:
    """``<store>.align-<first 16 hex of the student tokenizer's hash>.npz``, beside the store folder."""
    path = reader.path.resolve()
    return path.with_name(f"{path.name}.align-{student.fingerprint[:16]}.npz")


class StudentAlignments:
    """Sample index -> ``SampleAlignment`` of ``reader``'s store under ``student`` (module docstring)."""

    def __init__(self, reader, student):
        self.reader, self.student = reader, student
        self.teacher = reader.vocab_table()
        self._alignments: dict[int, SampleAlignment] = {}

    def __len__(self) -> int:
        return len(self._alignments)

    def known(self, sample: int) -> bool:
        return sample in self._alignments

    def _where(self, sample: int) -> str:
        return f"{self.reader.path} sample {sample}"

    def get(self, sample: int, tokens: np.ndarray | None = None) -> SampleAlignment:
        """The alignment of ``sample``, computed from its ``tokens`` [S + 1] (read when None) on first use."""
        alignment = self._alignments.get(sample)
        if alignment is None:
            if tokens is None:
                tokens = self.reader.sample_arrays(sample, (fmt.TOKENS,))[fmt.TOKENS]
            alignment = self._alignments[sample] = align_sample(tokens, self.teacher, self.student,
                                                                where=self._where(sample))
        return alignment

    @functools.cached_property
    def vocab_map(self) -> np.ndarray:
        """int64 [V_teacher]: ``align.identical_strings`` of the two tokenizers (computed once)."""
        return identical_strings(self.teacher, self.student)

    def row(self, sample: int, seq_length: int) -> dict:
        """The student row of ``sample`` (``align.alignment_row``), with the pair arrays unless the store is a sampled
        one (its slots are draws, not a top-K): reads the sample's realised log-probs and top-K (and its tokens)."""
        pairs = self.reader.spec.mode != "sampled"
        names = (fmt.REALISED_LOGPROB,) + ((fmt.IDS, fmt.LOGPROBS) if pairs else ()) + \
            ((fmt.TOKENS,) if pairs or not self.known(sample) else ())
        arrays = self.reader.sample_arrays(sample, names)
        alignment = self.get(sample, arrays.get(fmt.TOKENS))
        topk = TeacherTopK(arrays[fmt.TOKENS], arrays[fmt.IDS], arrays[fmt.LOGPROBS], self.vocab_map) if pairs else None
        return alignment_row(alignment, arrays[fmt.REALISED_LOGPROB], seq_length, topk)

    def prepare(self, samples) -> None:
        """Align every sample of ``samples`` not aligned yet, ``BLOCK`` texts per batch encode."""
        todo = [int(s) for s in samples if int(s) not in self._alignments]
        for begin in range(0, len(todo), BLOCK):
            block = todo[begin:begin + BLOCK]
            tokens = [self.reader.sample_arrays(s, (fmt.TOKENS,))[fmt.TOKENS] for s in block]
            texts = [valid_text(self.teacher.concat(t.astype(np.int64)).tobytes())[1] for t in tokens]
            for sample, sample_tokens, ids in zip(block, tokens, self.student.encode_batch(texts)):
                self._alignments[sample] = align_sample(sample_tokens, self.teacher, self.student, ids=ids,
                                                        where=self._where(sample))

    def save(self, path) -> None:
        """Every sample's alignment (all are computed first) into ``path``, atomically (module docstring)."""
        n = len(self.reader)
        self.prepare(range(n))
        items = [self._alignments[i] for i in range(n)]
        lengths = np.fromiter((len(a.ids) for a in items), dtype=np.int64, count=n)
        arrays = dict(ids=np.concatenate([a.ids for a in items]),
                      student_chunks=np.concatenate([a.student_chunks for a in items]),
                      offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                      teacher_chunks=np.stack([a.teacher_chunks for a in items]),
                      num_boundaries=np.asarray([a.num_boundaries for a in items], dtype=np.int64),
                      key=np.asarray(json.dumps(store_key(self.reader, self.student), sort_keys=True)))
        path = pathlib.Path(path)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as f:
                np.savez(f, **arrays)
            os.replace(temporary, path)
        except BaseException:
            pathlib.Path(temporary).unlink(missing_ok=True)
            raise

    def load(self, path) -> bool:
        """Take every alignment from the sidecar ``path``; False (nothing taken) when it is missing or of another
        key; ValueError naming the file when it is damaged."""
        path = pathlib.Path(path)
        if not path.is_file():
            return False
        try:
            with np.load(path, allow_pickle=False) as data:
                if json.loads(str(data["key"])) != store_key(self.reader, self.student):
                    return False
                ids, chunks, offsets = data["ids"], data["student_chunks"], data["offsets"]
                teacher_chunks, boundaries = data["teacher_chunks"], data["num_boundaries"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
            raise ValueError(f"{path}: damaged student-alignment sidecar ({error}); delete it to recompute") from error
        if len(offsets) != len(self.reader) + 1 or teacher_chunks.shape != (len(self.reader), self.reader.spec.seq_length):
            raise ValueError(f"{path}: damaged student-alignment sidecar (shapes do not match {self.reader.path})")
        for i in range(len(self.reader)):
            a, b = int(offsets[i]), int(offsets[i + 1])
            self._alignments[i] = SampleAlignment(ids[a:b], chunks[a:b], teacher_chunks[i], int(boundaries[i]))
        return True
