"""Each cached sample's student tokenization and segments, computed once, and a memory-mapped sidecar of them.

A cross-tokenizer row (``align.py``) costs the student tokenizer's encode of the sample's text and the alignment
(``align.align_sample``); both depend only on the sample's teacher tokens and the two tokenizers, not on the student's
seq_length or the teacher's log-probs. ``StudentAlignments`` computes each sample's ``SampleAlignment`` once (on
first use, or all at once in blocks with the tokenizer's batch encode: ``prepare``) and keeps it in memory, or maps
a whole store's from its sidecar; a row then costs the sample's log-prob reads and the cut (``row``). Memory of the
computed ones: ~4.5 B per student token + 4 B per teacher token (~11 GB for 10^9 teacher tokens); mapped ones live
in the page cache, one copy per machine whatever the number of processes reading them.

Sidecar (``save`` / ``load``): a folder next to the store, never inside it (default ``<store>.align-<student
hash>``, :func:`sidecar_path`), of raw little-endian arrays and their description::

    ids.bin [sum n] int32, student_segments.bin [sum n] int32, offsets.bin [N + 1] int64 (sample i:
    [offsets[i], offsets[i+1])), teacher_segments.bin [N, S] int32, num_boundaries.bin [N] int64,
    key.json: {"key": {"format", "store_identity", "student"}, "arrays": {name: {"dtype", "shape", "crc32c"}}}

(the store's identity attribute, the SHA-256 of the student's ``tokenizer.json``). ``save`` streams it, ``BLOCK``
samples at a time, into a temporary folder beside the target that is renamed over it at the end (atomic: a reader
never sees a partial sidecar; writers of one key write the same bytes). ``load`` checks the key (another store or
tokenizer: False, nothing taken, so the caller recomputes), every file's size and CRC32C (damage: ValueError naming
the file), then maps the files read-only. ``load_or_write``: the first process to take ``<sidecar>.lock`` computes
and writes the sidecar while the others wait for it, then every one maps it.
"""

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

from megatron_kd_plugin.cache import format as fmt
from megatron_kd_plugin.cache.rows import KDRow
from megatron_kd_plugin.cache.align import (SampleAlignment, TeacherTopK, align_sample, alignment_row,
                                            identical_strings, valid_text)

SIDECAR_FORMAT = "megatron_kd_plugin.student_alignments/3"
BLOCK = 64
"""Samples per batch encode in ``prepare`` and ``save``."""
SIDECAR_ARRAYS = {"ids": np.int32, "student_segments": np.int32, "offsets": np.int64, "teacher_segments": np.int32,
                  "num_boundaries": np.int64}
_CRC_BLOCK = 64 * 2**20


def store_key(reader, student) -> dict:
    """The sidecar key of ``reader``'s store and the ``student`` tokenizer (``TokenBytes``)."""
    identity = reader.group.attrs.get("identity") or fmt.store_identity(reader.spec)
    return {"format": SIDECAR_FORMAT, "store_identity": identity, "student": student.fingerprint}


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
        self._alignments: dict[int, SampleAlignment] = {}
        self._mapped: dict[str, np.ndarray] | None = None
        self._sidecar: pathlib.Path | None = None

    def __len__(self) -> int:
        return len(self.reader) if self._mapped is not None else len(self._alignments)

    def known(self, sample: int) -> bool:
        return self._mapped is not None or sample in self._alignments

    def _where(self, sample: int) -> str:
        return f"{self.reader.path} sample {sample}"

    def get(self, sample: int, tokens: np.ndarray | None = None) -> SampleAlignment:
        """The alignment of ``sample``: mapped from the sidecar, or computed from its ``tokens`` [S + 1] (read when
        None) on first use and kept."""
        alignment = self._alignments.get(sample)
        if alignment is not None:
            return alignment
        if self._mapped is not None:
            mapped = self._mapped
            begin, end = int(mapped["offsets"][sample]), int(mapped["offsets"][sample + 1])
            return SampleAlignment(mapped["ids"][begin:end], mapped["student_segments"][begin:end],
                                   mapped["teacher_segments"][sample], int(mapped["num_boundaries"][sample]))
        if tokens is None:
            tokens = self.reader.sample_arrays(sample, (fmt.TOKENS,))[fmt.TOKENS]
        alignment = self._alignments[sample] = align_sample(tokens, self.teacher, self.student,
                                                            where=self._where(sample))
        return alignment

    @functools.cached_property
    def vocab_map(self) -> np.ndarray:
        """int32 [V_teacher]: ``align.identical_strings`` of the two tokenizers (computed once)."""
        return identical_strings(self.teacher, self.student)

    def row(self, sample: int, seq_length: int) -> KDRow:
        """The student row of ``sample`` (``align.alignment_row``), with the pairs when the store holds a top-K (not
        draws): reads the sample's realised log-probs and top-K (and its tokens)."""
        pairs = self.reader.spec.mode == "topk"
        names = (fmt.REALISED_LOGPROB,) + ((fmt.IDS, fmt.LOGPROBS) if pairs else ()) + \
            ((fmt.TOKENS,) if pairs or not self.known(sample) else ())
        arrays = self.reader.sample_arrays(sample, names)
        alignment = self.get(sample, arrays.get(fmt.TOKENS))
        topk = TeacherTopK(arrays[fmt.TOKENS], arrays[fmt.IDS], arrays[fmt.LOGPROBS], self.vocab_map) if pairs else None
        return alignment_row(alignment, arrays[fmt.REALISED_LOGPROB], seq_length, topk)

    def _computed(self, samples):
        """(sample, alignment) of ``samples`` in order: known ones as they are, the others aligned ``BLOCK`` texts per
        batch encode."""
        samples = [int(s) for s in samples]
        for begin in range(0, len(samples), BLOCK):
            block = samples[begin:begin + BLOCK]
            todo = [s for s in block if not self.known(s)]
            tokens = [self.reader.sample_arrays(s, (fmt.TOKENS,))[fmt.TOKENS] for s in todo]
            texts = [valid_text(self.teacher.concat(t.astype(np.int64)).tobytes())[1] for t in tokens]
            aligned = {s: align_sample(t, self.teacher, self.student, ids=ids, where=self._where(s))
                       for s, t, ids in zip(todo, tokens, self.student.encode_batch(texts) if texts else [])}
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
        temporary = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp"))
        try:
            offsets, boundaries = np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64)
            crcs = dict.fromkeys(("ids", "student_segments", "teacher_segments"), 0)
            with open(temporary / "ids.bin", "wb") as ids_file, \
                    open(temporary / "student_segments.bin", "wb") as segments_file, \
                    open(temporary / "teacher_segments.bin", "wb") as teacher_file, \
                    tqdm(total=n * seq, unit="tok", unit_scale=True, disable=not progress, file=sys.stderr,
                         desc=f"aligning {self.reader.path.name} to {self.student.identity}") as bar:
                for sample, alignment in self._computed(range(n)):
                    for name, file, values in (("ids", ids_file, alignment.ids),
                                               ("student_segments", segments_file, alignment.student_segments),
                                               ("teacher_segments", teacher_file, alignment.teacher_segments)):
                        data = np.ascontiguousarray(values, dtype=SIDECAR_ARRAYS[name]).tobytes()
                        file.write(data)
                        crcs[name] = google_crc32c.extend(crcs[name], data)
                    offsets[sample + 1] = offsets[sample] + len(alignment.ids)
                    boundaries[sample] = alignment.num_boundaries
                    bar.update(seq)
            for name, values in (("offsets", offsets), ("num_boundaries", boundaries)):
                (temporary / f"{name}.bin").write_bytes(values.tobytes())
                crcs[name] = _crc32c(values)
            total = int(offsets[-1])
            shapes = {"ids": [total], "student_segments": [total], "offsets": [n + 1], "teacher_segments": [n, seq],
                      "num_boundaries": [n]}
            arrays = {name: {"dtype": np.dtype(dtype).str, "shape": shapes[name], "crc32c": crcs[name]}
                      for name, dtype in SIDECAR_ARRAYS.items()}
            (temporary / "key.json").write_text(json.dumps({"key": store_key(self.reader, self.student),
                                                            "arrays": arrays}, sort_keys=True, indent=1) + "\n")
            self._replace(temporary, path)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise

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
        n, seq = len(self.reader), self.reader.spec.seq_length
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
        offsets = mapped["offsets"]
        if mapped["teacher_segments"].shape != (n, seq) or offsets.shape != (n + 1,) or offsets[0] != 0 or \
                offsets[-1] != len(mapped["ids"]) or np.any(np.diff(offsets) < 0):
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
