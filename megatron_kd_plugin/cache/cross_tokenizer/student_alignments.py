"""Each cached sample's student tokenization and segments, computed once, and a memory-mapped sidecar of them.

A cross-tokenizer row (``align.py``) costs the student tokenizer's encode of the sample's text, the alignment and,
from a top-K store, the token-level term's slots (``align.align_sample``, ``token_slots``); they depend only on the
sample's cached arrays and the two tokenizers, not on the student's seq_length. ``StudentAlignments`` computes each
sample's ``SampleAlignment`` once (on first use, or all at once in blocks with the tokenizer's batch encode:
``prepare``) and keeps it in memory, or maps a whole store's from its sidecar; a row then costs the sample's reads
and the cut (``row``). The two tokenizers' ``first_tokens.FirstTokens`` table is computed once, for the slots.
Memory per sample: ``SampleAlignment``'s (~4.5 B per student token + 4 B per teacher token, and the slots); mapped
ones live in the page cache, one copy per machine whatever the number of processes reading them.

Sidecar (``save`` / ``load``): a folder next to the store, never inside it (default ``<store>.align-<student
hash>``, :func:`sidecar_path`), of raw little-endian arrays and their description::

    ids.bin [sum n] int32, student_segments.bin [sum n] int32, offsets.bin [N + 1] int64 (sample i:
    [offsets[i], offsets[i+1])), teacher_segments.bin [N, S] int32, num_boundaries.bin [N] int64,
    the token slots (``token_slots``; empty for a store without a top-K): sources.bin [sum n] int32,
    mid_counts.bin [sum n] uint8, mid_offsets.bin [N + 1] int64 (sample i's candidates), mid_ids.bin [E] int32,
    mid_logprobs.bin [E] float32, realised_slots.bin [N, S] int16, vocab_map.bin [V_teacher] int32,
    key.json: {"key": {"format", "store_identity", "student", "mid_candidates"}, "arrays": {name: {"dtype",
    "shape", "crc32c"}}}

(the store's identity attribute, the SHA-256 of the student's ``tokenizer.json``, ``token_slots.MID_CANDIDATES``).
``save`` streams it, ``BLOCK`` samples at a time, into a temporary folder beside the target that is renamed over it at
the end (atomic: a reader never sees a partial sidecar; writers of one key write the same bytes). ``load`` checks the
key (another store or tokenizer: False, nothing taken, so the caller recomputes), every file's size and CRC32C (damage:
ValueError naming the file), then maps the files read-only. ``load_or_write``: the first process to take
``<sidecar>.lock`` computes and writes the sidecar while the others wait for it, then every one maps it. """

from __future__ import annotations

import fcntl
import functools
import json
import os
import pathlib
import shutil
import sys
import tempfile

import google_crc32c
import numpy as np

from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.cross_tokenizer.align import (SampleAlignment, TeacherTopK, align_sample, alignment_row,
                                                            valid_text)
from megatron_kd_plugin.cache.cross_tokenizer.first_tokens import FirstTokens
from megatron_kd_plugin.cache.rows.kd_rows import KDRow
from megatron_kd_plugin.cache.cross_tokenizer.token_slots import MID_CANDIDATES, TokenSlots

SIDECAR_FORMAT = "megatron_kd_plugin.student_alignments/4"
BLOCK = 64
"""Samples per batch encode in ``prepare`` and ``save``."""
SIDECAR_ARRAYS = {"ids": np.int32, "student_segments": np.int32, "offsets": np.int64, "teacher_segments": np.int32,
                  "num_boundaries": np.int64, "sources": np.int32, "mid_counts": np.uint8, "mid_offsets": np.int64,
                  "mid_ids": np.int32, "mid_logprobs": np.float32, "realised_slots": np.int16,
                  "vocab_map": np.int32}
_PER_STUDENT_TOKEN = ("ids", "student_segments", "sources", "mid_counts")
_PER_CANDIDATE = ("mid_ids", "mid_logprobs")
_CRC_BLOCK = 64 * 2**20


def store_key(reader, student) -> dict:
    """The sidecar key of ``reader``'s store and the ``student`` tokenizer (``TokenBytes``)."""
    identity = reader.group.attrs.get("identity") or fmt.store_identity(reader.spec)
    return {"format": SIDECAR_FORMAT, "store_identity": identity, "student": student.fingerprint,
            "mid_candidates": MID_CANDIDATES}


def sidecar_path(reader, student) -> pathlib.Path:
    """``<store>.align-<first 16 hex of the student tokenizer's hash>``, beside the store folder."""
    path = reader.path.resolve()
    return path.with_name(f"{path.name}.align-{student.fingerprint[:16]}")


def _crc32c(array: np.ndarray) -> int:
    """CRC32C of an array's bytes, read in blocks (a mapped file is not read whole into memory)."""
    data, crc = array.reshape(-1).view(np.uint8), 0
    for start in range(0, len(data), _CRC_BLOCK):
        crc = google_crc32c.extend(crc, data[start:start + _CRC_BLOCK].tobytes())
    return crc


class StudentAlignments:
    """Sample index -> ``SampleAlignment`` of ``reader``'s store under ``student`` (module docstring)."""

    def __init__(self, reader, student):
        self.reader, self.student = reader, student
        self.teacher = reader.vocab_table()
        self.with_slots = reader.spec.kind.exact_slots
        self._alignments: dict[int, SampleAlignment] = {}
        self._mapped: dict[str, np.ndarray] | None = None
        self._sidecar: pathlib.Path | None = None

    def __len__(self) -> int:
        return len(self.reader) if self._mapped is not None else len(self._alignments)

    def known(self, sample: int) -> bool:
        return self._mapped is not None or sample in self._alignments

    def _where(self, sample: int) -> str:
        return f"{self.reader.path} sample {sample}"

    @property
    def names(self) -> tuple[str, ...]:
        """The stored arrays a sample's alignment is computed from."""
        return (fmt.TOKENS,) + ((fmt.IDS, fmt.LOGPROBS, fmt.REALISED_LOGPROB) if self.with_slots else ())

    def _topk(self, arrays: dict[str, np.ndarray]) -> TeacherTopK | None:
        return TeacherTopK(arrays[fmt.IDS], arrays[fmt.LOGPROBS], arrays[fmt.REALISED_LOGPROB]) \
            if self.with_slots else None

    def _align(self, sample: int, arrays: dict[str, np.ndarray], ids=None) -> SampleAlignment:
        topk = self._topk(arrays)
        return align_sample(arrays[fmt.TOKENS], self.teacher, self.student, ids=ids, where=self._where(sample),
                            topk=topk, table=self.table if topk is not None else None)

    def get(self, sample: int, arrays: dict[str, np.ndarray] | None = None) -> SampleAlignment:
        """The alignment of ``sample``: mapped from the sidecar, or computed from its ``arrays`` (``names``; read when
        None) on first use and kept."""
        alignment = self._alignments.get(sample)
        if alignment is not None:
            return alignment
        if self._mapped is not None:
            return self._mapped_alignment(sample)
        if arrays is None:
            arrays = self.reader.sample_arrays(sample, self.names)
        alignment = self._alignments[sample] = self._align(sample, arrays)
        return alignment

    def _mapped_alignment(self, sample: int) -> SampleAlignment:
        mapped = self._mapped
        begin, end = int(mapped["offsets"][sample]), int(mapped["offsets"][sample + 1])
        slots = None
        if self.with_slots:
            first, last = int(mapped["mid_offsets"][sample]), int(mapped["mid_offsets"][sample + 1])
            slots = TokenSlots(mapped["sources"][begin:end], mapped["realised_slots"][sample],
                               mapped["mid_counts"][begin:end], mapped["mid_ids"][first:last],
                               mapped["mid_logprobs"][first:last])
        return SampleAlignment(mapped["ids"][begin:end], mapped["student_segments"][begin:end],
                               mapped["teacher_segments"][sample], int(mapped["num_boundaries"][sample]), slots)

    @functools.cached_property
    def table(self) -> FirstTokens:
        """The two tokenizers' ``first_tokens.FirstTokens`` (computed once, for the token slots)."""
        return FirstTokens.compute(self.teacher, self.student)

    @functools.cached_property
    def vocab_map(self) -> np.ndarray:
        """int32 [V_teacher]: the student's first token of each teacher token (``FirstTokens.vocab_map``), from the
        sidecar when mapped."""
        return self._mapped["vocab_map"] if self._mapped is not None else self.table.vocab_map

    def row(self, sample: int, seq_length: int) -> KDRow:
        """The student row of ``sample`` (``align.alignment_row``), with the token slots when the store holds a top-K
        (not draws): reads the sample's realised log-probs and top-K (and, aligning it now, its tokens)."""
        names = (fmt.REALISED_LOGPROB,) + ((fmt.IDS, fmt.LOGPROBS) if self.with_slots else ())
        arrays = self.reader.sample_arrays(sample, names + ((fmt.TOKENS,) if not self.known(sample) else ()))
        alignment = self.get(sample, arrays)
        return alignment_row(alignment, arrays[fmt.REALISED_LOGPROB], seq_length, self._topk(arrays),
                             self.vocab_map if self.with_slots else None)

    def _computed(self, samples):
        """(sample, alignment) of ``samples`` in order: known ones as they are, the others aligned ``BLOCK`` texts per
        batch encode."""
        samples = [int(s) for s in samples]
        for begin in range(0, len(samples), BLOCK):
            block = samples[begin:begin + BLOCK]
            todo = [s for s in block if not self.known(s)]
            arrays = [self.reader.sample_arrays(s, self.names) for s in todo]
            texts = [valid_text(self.teacher.concat(a[fmt.TOKENS].astype(np.int64)).tobytes())[1] for a in arrays]
            aligned = {s: self._align(s, a, ids) for s, a, ids in
                       zip(todo, arrays, self.student.encode_batch(texts) if texts else [])}
            for sample in block:
                yield sample, aligned[sample] if sample in aligned else self.get(sample)

    def prepare(self, samples) -> None:
        """Align every sample of ``samples`` not known yet and keep them in memory, ``BLOCK`` texts per batch encode."""
        for sample, alignment in self._computed(samples):
            self._alignments.setdefault(sample, alignment)

    def save(self, path, *, progress: bool = False) -> None:
        """Every sample's alignment into the sidecar folder ``path``, streamed (one block in memory) and renamed into
        place at the end (module docstring); ``progress``: a tqdm bar on stderr."""
        from tqdm import tqdm

        path = pathlib.Path(path)
        n, seq = len(self.reader), self.reader.spec.seq_length
        streamed = ("ids", "student_segments", "teacher_segments") + \
            (("sources", "mid_counts", "mid_ids", "mid_logprobs", "realised_slots") if self.with_slots else ())
        temporary = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp"))
        try:
            offsets, boundaries = np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64)
            mid_offsets = np.zeros(n + 1 if self.with_slots else 0, dtype=np.int64)
            crcs = dict.fromkeys(SIDECAR_ARRAYS, 0)
            files = {name: open(temporary / f"{name}.bin", "wb") for name in streamed}
            try:
                with tqdm(total=n * seq, unit="tok", unit_scale=True, disable=not progress, file=sys.stderr,
                          desc=f"aligning {self.reader.path.name} to {self.student.identity}") as bar:
                    for sample, alignment in self._computed(range(n)):
                        slots = alignment.slots
                        values = {"ids": alignment.ids, "student_segments": alignment.student_segments,
                                  "teacher_segments": alignment.teacher_segments}
                        if self.with_slots:
                            values.update(sources=slots.sources, mid_counts=slots.mid_counts, mid_ids=slots.mid_ids,
                                          mid_logprobs=slots.mid_logprobs, realised_slots=slots.realised)
                            mid_offsets[sample + 1] = mid_offsets[sample] + len(slots.mid_ids)
                        for name in streamed:
                            data = np.ascontiguousarray(values[name], dtype=SIDECAR_ARRAYS[name]).tobytes()
                            files[name].write(data)
                            crcs[name] = google_crc32c.extend(crcs[name], data)
                        offsets[sample + 1] = offsets[sample] + len(alignment.ids)
                        boundaries[sample] = alignment.num_boundaries
                        bar.update(seq)
            finally:
                for file in files.values():
                    file.close()
            whole = {"offsets": offsets, "num_boundaries": boundaries, "mid_offsets": mid_offsets,
                     "vocab_map": self.vocab_map if self.with_slots else np.zeros(0, np.int32)}
            for name in SIDECAR_ARRAYS.keys() - set(streamed) - set(whole):
                whole[name] = np.zeros(0, SIDECAR_ARRAYS[name])                     # no token slots: empty
            for name, values in whole.items():
                (temporary / f"{name}.bin").write_bytes(np.ascontiguousarray(values, SIDECAR_ARRAYS[name]).tobytes())
                crcs[name] = _crc32c(np.ascontiguousarray(values, SIDECAR_ARRAYS[name]))
            shapes = self._shapes(int(offsets[-1]), int(mid_offsets[-1]) if self.with_slots else 0)
            arrays = {name: {"dtype": np.dtype(dtype).str, "shape": shapes[name], "crc32c": crcs[name]}
                      for name, dtype in SIDECAR_ARRAYS.items()}
            (temporary / "key.json").write_text(json.dumps({"key": store_key(self.reader, self.student),
                                                            "arrays": arrays}, sort_keys=True, indent=1) + "\n")
            self._replace(temporary, path)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise

    def _shapes(self, student_tokens: int, candidates: int) -> dict[str, list[int]]:
        """Each sidecar array's shape for ``student_tokens`` student tokens and ``candidates`` kept candidates."""
        n, seq, slots = len(self.reader), self.reader.spec.seq_length, self.with_slots
        shapes = {"offsets": [n + 1], "teacher_segments": [n, seq], "num_boundaries": [n],
                  "mid_offsets": [n + 1 if slots else 0], "realised_slots": [n if slots else 0, seq],
                  "vocab_map": [len(self.teacher.strings) if slots else 0]}
        shapes.update({name: [student_tokens if slots or name in ("ids", "student_segments") else 0]
                       for name in _PER_STUDENT_TOKEN})
        shapes.update({name: [candidates] for name in _PER_CANDIDATE})
        return shapes

    def _replace(self, temporary: pathlib.Path, path: pathlib.Path) -> None:
        """Rename the finished ``temporary`` folder to ``path``; a sidecar already there of this key (a concurrent
        writer's, the same bytes) is kept and ours dropped, one of another key (a stale one) is replaced."""
        try:
            os.rename(temporary, path)
            return
        except OSError:
            if not path.is_dir():
                raise
        if self._key_of(path) == store_key(self.reader, self.student):
            shutil.rmtree(temporary)
            return
        stale = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".", suffix=".stale"))
        os.rename(path, stale / "old")
        os.rename(temporary, path)
        shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def _key_of(path: pathlib.Path) -> dict | None:
        try:
            return json.loads((path / "key.json").read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def __getstate__(self) -> dict:
        """Pickled (a data-loader worker started by spawn), a mapped sidecar travels as its path, not its data."""
        return dict(self.__dict__, _mapped=None)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._sidecar is not None:
            self.load(self._sidecar, verify=False)

    def load(self, path, *, verify: bool = True) -> bool:
        """Map every alignment from the sidecar folder ``path``; False (nothing taken) when it is missing or of another
        key; ValueError naming the file when it is damaged (a size, or with ``verify`` a CRC32C, that does not match
        its description)."""
        path = pathlib.Path(path)
        if not (path / "key.json").is_file():
            return False
        damaged = f"{path}: damaged student-alignment sidecar"
        try:
            description = json.loads((path / "key.json").read_text())
            key, arrays = description["key"], description["arrays"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{damaged} ({path / 'key.json'}: {error}); delete it to recompute") from error
        if key != store_key(self.reader, self.student):
            return False
        mapped = {}
        for name, dtype in SIDECAR_ARRAYS.items():
            file = path / f"{name}.bin"
            try:
                meta = arrays[name]
                shape = tuple(int(d) for d in meta["shape"])
                size = file.stat().st_size
            except (OSError, KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{damaged} ({file}: {error}); delete it to recompute") from error
            if np.dtype(meta["dtype"]) != np.dtype(dtype) or size != int(np.prod(shape)) * np.dtype(dtype).itemsize:
                raise ValueError(f"{damaged} ({file}: {size} bytes, expected {shape} {np.dtype(dtype)}); delete it to "
                                 "recompute")
            values = np.memmap(file, dtype=dtype, mode="r", shape=shape) if size else np.zeros(shape, dtype=dtype)
            if verify and _crc32c(values) != meta["crc32c"]:
                raise ValueError(f"{damaged} ({file}: CRC32C mismatch); delete it to recompute")
            mapped[name] = values
        shapes = self._shapes(len(mapped["ids"]), len(mapped["mid_ids"]))
        bounds = [(mapped["offsets"], len(mapped["ids"]))] + \
            ([(mapped["mid_offsets"], len(mapped["mid_ids"]))] if self.with_slots else [])
        if any(list(mapped[name].shape) != shape for name, shape in shapes.items()) or any(
                offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0) for offsets, total in bounds):
            raise ValueError(f"{damaged} (its shapes or offsets do not match {self.reader.path}); delete it to "
                             "recompute")
        self._mapped, self._sidecar = mapped, path
        return True


def load_or_write(alignments: StudentAlignments, path, *, progress: bool = True) -> None:
    """Map the sidecar ``path`` into ``alignments``; when it is missing or stale, the first process to take the lock
    ``<path>.lock`` (a POSIX record lock, dropped by the OS if the process dies) computes and writes it while the
    others wait, then every one maps it. OSError where the folder is read-only (nothing is taken then)."""
    path = pathlib.Path(path)
    if alignments.load(path):
        return
    lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"[student alignments] another process is writing {path}; waiting for it", file=sys.stderr,
                  flush=True)
            fcntl.lockf(lock, fcntl.LOCK_EX)
        if not alignments.load(path):
            alignments.save(path, progress=progress)
            alignments.load(path)
    finally:
        os.close(lock)
