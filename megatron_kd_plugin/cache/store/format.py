"""The teacher top-K cache: one Zarr v3 group, plain zarr (``zarr.open_group(path)`` shows it).

Layout for N samples of S tokens, top-K, shards of P samples (``samples_per_shard``, default
:func:`default_samples_per_shard`: 2^20 tokens a shard)::

    tokens             int32   [N, S+1]  chunks [1, S+1]  shards [P, S+1]  blosc-zstd, byte shuffle      fill -1
    teacher_ids        int32   [N, S, K] chunks [1, S, K] shards [P, S, K] delta filter, blosc-zstd, byte shuffle -1
                                                    (bit shuffle with the log-prob codecs before grid8)
    teacher_logprobs   float32 [N, S, K] same chunks/shards   grid8: log-prob grid serializer, blosc-zstd      NaN
                       fp16|fp32 (older codecs)                (bit-rounding filter), blosc-zstd, byte shuffle
    teacher_logsumexp  float32 [N, S]    (only with ``store_logsumexp``) chunks [1, S] shards [P, S]          NaN
    teacher_proposal_lognorm float32 [N, S] (sampled stores with t != 1 only, see below) same chunks/shards    NaN
    teacher_realised_logprob  (cross-tokenizer stores only, see below) log-prob codec [N, S] chunks [1, S] shards [P, S]  NaN
    teacher_vocab_offsets     (cross-tokenizer stores only) int64 [V+1] one chunk                                        -1
    teacher_vocab_bytes       (cross-tokenizer stores only) uint8 [vocab_bytes] one chunk                                 0
    loss_mask          uint8   [N, S]    (documents layouts only, version 6) chunks [1, S] shards [P, S]      255
    position_ids       int32   [N, S]    (documents layouts only) delta filter, blosc-zstd, same chunks/shards  -1
    chunk_records      uint32  [N, A]    one chunk [P, A] per shard, uncompressed — binds each chunk (below);
                                         written last: a shard is written when its chunk_records file exists   0
    .writer.lock       an empty file; every process of a writing run holds a POSIX lock on it (``lock.py``)

Files (format version 5, issue #37): chunk keys use the separator ``.`` (``teacher_ids/c.12.0.0``), so every array
is one folder of one file per shard and nothing else: a store holds A + 2 files per shard (the per-sample arrays and
their records; 4 for a top-K store, ~3.8 per 10^6 tokens at the default shard size) plus its metadata, and its
largest folder has N/P entries (95,367 at 10^11 tokens). Which shards are written is read from the ``chunk_records``
files themselves (:func:`written_shards`: a shard's records are written after its data, by an atomic rename), so
the writer keeps no progress array and rewrites no metadata while it writes: its bookkeeping per shard does not
grow with the store. Versions 2 to 4 (``/`` chunk keys, a ``shard_done`` array of one chunk per shard marking the
written shards) are still read.

Integrity (format versions 3 to 5): every chunk, inner chunks of shards included, ends with its
CRC32C (zarr's ``crc32c`` codec, the last codec of each chain), and the shard index carries its own CRC32C
(the sharding codec's index codecs). The fill values are values no written chunk can hold (ids and tokens
are >= 0, log-probs and logsumexps are finite), so zarr stores every inner chunk of a written shard, and in a
complete store a missing shard file or an empty index entry is damage, not data. The group attribute
``identity`` is the SHA-256 of ``format``, ``version`` and every :class:`CacheSpec` field (:func:`store_identity`):
the checksum of the attributes that decide how rows are read and trained on, and the store's identity.
``chunk_records[i, a]`` = CRC32C(identity, name of array a, i, the stored CRC32C of sample i's chunk of array a)
over the A per-sample arrays (those whose first dimension is ``sample``, sorted by name; the records array's
attribute ``arrays`` lists them): it binds every chunk to its array, its sample and its store (``records.py``
checks it on every read). :func:`open_store` checks the identity and compares every array's whole zarr.json
(normalised by zarr's own metadata classes: shapes, dtype, chunk grid, codecs with every setting, fill value,
dimension names) with what :func:`create_store` writes for the store's attributes, before any read. Version 2
stores (no identity, no records) are read with a warning; version 1 stores (no chunk checksums, fill value 0)
are refused with a message saying how to rewrite them.

Row t of sample i is the teacher's distribution over token ``tokens[i, t+1]`` given ``tokens[i, :t+1]``:
``teacher_logprobs[i, t, k] = log softmax(z / τ_c)[teacher_ids[i, t, k]]`` normalised over the teacher's FULL
vocabulary at the cache temperature τ_c, so ``Σ_k exp(·) = m <= 1`` is the top-K mass;
``teacher_logsumexp[i, t] = LSE(z / τ_c)``. Within a row the K ids are sorted ascending by id (not by rank) and
the log-probs follow the same order: a sorted K-subset of the vocabulary delta-codes to ~130 B/token at K=100,
V=32k (~166 at V=201k) against ~197 (~235) for rank order (``tools/bench_cache.py``, docs/reference/store-format.md); on trained
teachers blosc's byte shuffle of the deltas beats its bit shuffle by a third (their rows repeat the gap patterns
of frequent ids). Ids are int32: vocabularies up to 2^31. The default log-prob codec ``grid8``
(``logprob_grid.py``) stores each row as its float16 maximum and one 8-bit code per slot on a fixed grid below it
(exact −inf for padding slots): ~70 B/token at K=100 on the trained teachers of ``tools/bench_codec.py`` at a mean
round-trip KL of 3-6e-4 nats, against ~100 B/token and ~2e-5 for the fp16 bit-rounded to 7 mantissa bits
(``fp16-bitround7``) it replaced, which stays readable and writable (docs/reference/store-format.md).

Sampled stores (``mode="sampled"``, ``format`` :data:`SAMPLED_FORMAT_NAME`, issue #8): the same arrays with K = N
draws per token from the proposal q ∝ p^(1/t) (``draws.py``): ``teacher_ids`` holds the N drawn ids sorted
ascending with duplicates kept (a repeat delta-codes to 0, so the multiplicity costs ~nothing; this measured
smaller than distinct ids + uint8 counts, docs/reference/store-format.md), ``teacher_logprobs`` the teacher's l of each (same
codec), and, only when t != 1, ``teacher_proposal_lognorm`` float32 [samples, S] = G = logsumexp_v(l_v / t). A reader
computes the importance weights w = (1/N)·exp(l·(1 − 1/t) + G) per slot (``draws.draw_weights``).

Top-p stores (``top_p`` set, ``cache --top-p P --min-k M``, issue #21, format version 4): K is the cap; row t keeps
the smallest prefix of the teacher's ranked top-K whose mass reaches P, at least M ids (``topk.top_p_mask``), and
its other K − kept slots are padding: id 0 with log-prob −inf, FIRST in the row, the kept ids ascending after them
(so a row stays sorted, 0 ≤ every id, and the id range check still reads its ends; a padding run delta-codes to
zeros and −inf repeats, ~nothing after blosc). A kept id 0 follows the padding. Consumers treat a −inf slot as no
support (``loss/teacher.py``); ``inspect`` counts the finite slots. Version 4 was written only for top-p stores, so
a version-3 reader refuses them by their version instead of serving padding it does not know; the top-p attributes
are in the attributes (and the identity) of top-p stores only.

Cross-tokenizer stores (``vocab_bytes`` > 0, ``cache --cross-tokenizer``, issue #18) also hold what a student
with another tokenizer needs (``megatron_kd_plugin.cache.cross_tokenizer.align``): ``teacher_realised_logprob[i, t]`` =
the teacher's log-prob of the realised next token ``tokens[i, t+1]`` (in the top-K or not), in the log-prob codec; and
the teacher tokenizer's byte table: token id v is the bytes ``teacher_vocab_bytes[o[v]:o[v+1]]``, o =
``teacher_vocab_offsets`` (``token_bytes.py``). A sample's text is the concatenation of its tokens' bytes and token t's
byte span within it ends at the cumulative sum of the lengths, so the spans cost no bytes on disk; only the realised
log-prob is per token (~1.2 B/token in fp16-bitround7, the codec of this array when the log-prob codec is a grid, which
needs rows of several slots; docs/reference/store-format.md).

Group attributes: ``format`` (:data:`FORMAT_NAME` or :data:`SAMPLED_FORMAT_NAME`), ``version``
(:data:`FORMAT_VERSION`), every field of :class:`CacheSpec` (mode, K, vocab size, seq_length, sample count, cache
temperature, teacher and tokenizer identity, source-data fingerprint, log-prob codec, shard size, proposal
temperature, sample seed; top_p and min_k in top-p stores only), ``identity`` (versions 3 to 5) and ``complete``
(versions 2 to 4 also ``progress``).

Documents (``layout`` "packed" or "document", ``cache --layout``, issue #49, format version 6): the rows hold whole
documents, each attended by the teacher within itself only, with positions restarting at 0 at its first token
(``megatron_kd_plugin.documents``). ``loss_mask[i, t]`` = 1 when the label ``tokens[i, t+1]`` is a loss target
(0 at a document's last token, on padding and on prompt tokens); ``position_ids[i, t]`` counts up from 0 within each
document. At a token of loss mask 0 every kind of store holds padding slots (id 0, log-prob −inf: the loss reads
nothing there, a draw there weighs 0; ``writer.pad_unread_tokens``; sampled stores written before 2026-12-07 hold
the teacher's draws there, read alike). A stream store (version 5, and every earlier version) holds neither array:
its loss mask reads as all ones and its positions as 0..S-1
(``reader.py``). Version 6 is written only for documents, so a version-5 reader refuses such a store by its
version.

Writing (``writer.py``): one writer rank owns whole shards, so no two ranks ever touch the same file; a shard's
arrays are written first, then its ``chunk_records`` (from the chunks' stored CRC32Cs, read back), each file replaced
atomically by zarr's LocalStore. A killed run restarted with the same settings redoes only the shards whose records
are missing, each rank checking its own, and because the data of a shard depend only on that shard's samples, the
result is byte-identical to an uninterrupted run. ``complete`` turns true (one atomic rewrite of the group's
``zarr.json``) only after every shard is written; a reader refuses an incomplete store and names the missing
samples.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import os
import pathlib
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.codecs import numcodecs as numcodecs_zarr3
from zarr.core.buffer import default_buffer_prototype
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.errors import ZarrUserWarning

from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.store.array_names import (ARRAYS, IDS, LOGPROBS, LOGSUMEXP,  # noqa: F401
                                                        LOSS_MASK, POSITION_IDS, PROPOSAL_LOGNORM, REALISED_LOGPROB, RECORDS, SHARD_DONE, TOKENS,
                                                        VOCAB_BYTES, VOCAB_OFFSETS, VOCAB_TABLE)
from megatron_kd_plugin.cache.kinds import MODES, STORE_KINDS, StoreKind, check_kind_fields, store_kind
from megatron_kd_plugin.cache.store.lock import LOCK_NAME, WriterLock
from megatron_kd_plugin.cache.logprob_grid import LogprobGridZarr

FORMAT_NAME = "megatron_kd_plugin.topk_cache"
SAMPLED_FORMAT_NAME = "megatron_kd_plugin.sampled_cache"
FORMAT_NAMES = {"topk": FORMAT_NAME, "sampled": SAMPLED_FORMAT_NAME}
"""The ``format`` attribute of each ``mode`` (``kinds.MODES``)."""
assert set(FORMAT_NAMES) == set(MODES)
FORMAT_VERSION = 5
"""The version every new store is written in. 5: ``.`` chunk keys (one folder per array, one file per shard) and no
``shard_done`` array (a shard is written when its ``chunk_records`` file exists), issue #37; 4: version 3 plus
top-p truncation (``top_p``, ``min_k``: rows with padding slots), written only for top-p stores, so a version-3
reader refused them by their version; 3: the attributes' SHA-256 identity and ``chunk_records`` binding every chunk to
its place (2: without them; read with a warning); 2 to 4: CRC32C on every chunk and fill values no written chunk
holds (1: neither; refused, see :meth:`CacheSpec.from_attrs`)."""
DOCUMENTS_VERSION = 6
"""The version of a store whose rows are documents (``layout`` "packed" or "document", issue #49): version 5 plus the
``layout`` attribute and the per-sample arrays ``loss_mask`` and ``position_ids``; written only for those stores, so a
version-5 reader refuses them by their version instead of training on their rows as one stream. A ``stream`` store
stays version 5: its loss mask is all ones and its positions 0..S-1, which every reader supplies."""
READ_VERSIONS = (2, 3, 4, 5, 6)
LAYOUTS = ("stream", "packed", "document")
"""How a store's rows hold its documents (``cache/layouts/``): one token stream cut into windows; whole documents
packed into rows, attended within each document only; one document per row, padded."""
KIND_FIELDS = tuple(dict.fromkeys(name for kind in STORE_KINDS for name in kind.described_fields))
"""The :class:`CacheSpec` fields that only one kind's stores carry in their attributes and identity (top-p: ``top_p``,
``min_k``; head + draws: ``head``; ``kinds.StoreKind.described_fields``)."""


GRID8 = (1 / 40, 0.5, 0.5, 24.0)
"""(step, growth, max_step, span) of the default log-prob grid (``grid8``), chosen by ``tools/bench_codec.py``."""


@dataclass(frozen=True, kw_only=True)
class LogprobCodec:
    """How the top-K log-probs (and the delta-coded ids beside them) are stored on disk."""

    dtype: str
    """numpy dtype of the stored values ("float16" or "float32"; zarr has no bfloat16); a grid codec decodes to
    float32."""
    keepbits: int | None = None
    """Mantissa bits kept by a round-to-nearest bit-rounding filter (None: all); 7 is bfloat16's precision."""
    grid: tuple[float, float, float, float] | None = None
    """(step, growth, max_step, span) of the log-prob grid serializer (``logprob_grid.py``: a float16 row maximum
    and one 8-bit code per slot); None: the values are stored as ``dtype`` floats."""
    ids_shuffle: str = "bitshuffle"
    """Blosc's shuffle of the delta-coded int32 ids: "bitshuffle" (the codecs before the grid) or "shuffle" (bytes:
    a real teacher's rows repeat gap patterns of its frequent ids, which zstd finds only byte-wise; docs/store-kinds-and-loss.md)."""


LOGPROB_CODECS = {
    "fp32": LogprobCodec(dtype="float32"),
    "fp16": LogprobCodec(dtype="float16"),
    "fp16-bitround8": LogprobCodec(dtype="float16", keepbits=8),
    "fp16-bitround7": LogprobCodec(dtype="float16", keepbits=7),
    "grid8": LogprobCodec(dtype="float32", grid=GRID8, ids_shuffle="shuffle"),
}
"""Named log-prob codecs; ``tools/bench_codec.py`` measures bytes/token and round-trip KL of each (docs/store-kinds-and-loss.md)."""
REALISED_CODEC = LOGPROB_CODECS["fp16-bitround7"]
"""The codec of ``teacher_realised_logprob`` (one value per token) in stores whose log-prob codec is a grid."""

DEFAULT_LOGPROB_CODEC = "grid8"
DEFAULT_DRAWS_CODEC = "fp16-bitround7"
"""The default of a store of draws (``kinds.DrawsStore.default_codec``): a grid's mass balance is a top-K row's
(``logprob_grid.py``), and in a row of draws, where ids repeat and their probabilities sum past 1, it moves each
repeat's code its own way (the distinct drawn mass decoded up to 1.07 on a confident teacher,
``tests/test_cache_store.py``)."""
assert {kind.default_codec for kind in STORE_KINDS} == {DEFAULT_LOGPROB_CODEC, DEFAULT_DRAWS_CODEC}


def check_logprob_codec(kind: StoreKind, codec: str) -> None:
    """ValueError for a log-prob codec that cannot store ``kind``'s rows (a grid for draws)."""
    if not kind.grid_codec and LOGPROB_CODECS[codec].grid is not None:
        raise ValueError(f"log-prob codec {codec!r} with draws: its mass balance is a top-K row's and distorts the "
                         f"log-probs of repeated draws; use {kind.default_codec!r} (the default with --draws) or "
                         "'fp32'")


SHARD_TOKENS = 1 << 20
"""Tokens a shard holds by default (:func:`default_samples_per_shard`), chosen by ``tools/bench_store_scale.py``
(docs/caching.md "At scale"): ~3.8 files per 10^6 tokens, at most 95,367 shard files in a folder at 10^11 tokens, a
writer's shard buffers ~0.8 GB at K = 100, at most one shard of work per writer lost to a kill."""


def default_samples_per_shard(seq_length: int) -> int:
    """Samples per shard by default: :data:`SHARD_TOKENS` tokens (at least one sample)."""
    return max(1, SHARD_TOKENS // seq_length)


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """What a store holds; written as the group attributes and compared on resume and by readers."""

    k: int
    """Slots per token: the top-K ids (mode "topk") or the N draws (mode "sampled")."""
    vocab_size: int
    """The teacher's vocabulary size (ids are < vocab_size)."""
    seq_length: int
    """Tokens per sample S (each sample stores S+1 tokens and S rows of top-K)."""
    num_samples: int
    """Samples N in the store."""
    temperature: float = 1.0
    """Cache temperature τ_c the log-probs are normalised at."""
    teacher: str = ""
    """Teacher identity (checkpoint path and content hash)."""
    tokenizer: str = ""
    """Tokenizer identity (file name and content hash, or a name)."""
    fingerprint: str = ""
    """Content hash of the source token data and the windowing (seq_length, sample count)."""
    logprob_codec: str | None = None
    """A key of :data:`LOGPROB_CODECS` (None: the kind's default, ``kinds.StoreKind.default_codec``)."""
    samples_per_shard: int | None = None
    """Samples per shard file, the unit one writer rank owns and the resume granularity (None:
    :func:`default_samples_per_shard` of ``seq_length``)."""
    store_logsumexp: bool = False
    """Also store the teacher's full-vocab logsumexp per token."""
    mode: str = "topk"
    """``topk``: the K most likely ids; ``sampled``: N ids drawn from q ∝ p^(1/t) (``draws.py``). With the fields
    below it picks the store's kind (:attr:`kind`, ``kinds/``)."""
    proposal_temperature: float = 1.0
    """t of the sampled mode's proposal (1 in the top-K mode)."""
    sample_seed: int = 0
    """Seed of the sampled mode's uniforms, drawn per (seed, sample index) (0 in the top-K mode)."""
    vocab_bytes: int = 0
    """Cross-tokenizer arrays (``--cross-tokenizer``) when > 0: the length of the teacher vocabulary's byte table
    ``teacher_vocab_bytes``; the store then also holds ``teacher_realised_logprob`` (0: neither)."""
    top_p: float | None = None
    """Top-p truncation (``--top-p``, mode "topk" only): per token, the smallest set of highest-probability ids whose
    mass reaches top_p, at least ``min_k`` and at most ``k`` (``topk.top_p_mask``); the other slots of the row are
    padding (log-prob -inf, id 0, first in the row). None: every row holds its top-K."""
    min_k: int | None = None
    """The least number of ids a top-p store keeps per token (``--min-k``, 1 <= min_k <= k); None without top_p."""
    layout: str = "stream"
    """A key of :data:`LAYOUTS`. Not "stream": the store is version :data:`DOCUMENTS_VERSION`, records ``layout`` (in
    its attributes and identity) and holds ``loss_mask`` and ``position_ids``; a stream store carries neither."""
    head: int = 0
    """Head + draws (``--head H --draws N``, mode "sampled", k = H + N): per token the exact top-H ids first, then N
    ids drawn from the teacher restricted to the rest of the vocabulary (``head_draws.py``). 0: draws only."""

    def __post_init__(self):
        if self.samples_per_shard is None and isinstance(self.seq_length, int) and self.seq_length >= 1:
            object.__setattr__(self, "samples_per_shard", default_samples_per_shard(self.seq_length))
        for name in ("k", "vocab_size", "seq_length", "num_samples", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        kind = store_kind(self)
        for name, value in kind.defaults(self).items():
            object.__setattr__(self, name, value)
        if self.logprob_codec is None:
            object.__setattr__(self, "logprob_codec", kind.default_codec)
        check_kind_fields(self, kind)
        kind.check(self)
        if self.vocab_bytes < 0:
            raise ValueError(f"vocab_bytes must be >= 0, got {self.vocab_bytes}")
        if self.vocab_size > 2**31:
            raise ValueError(f"vocab_size={self.vocab_size} does not fit int32 ids")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.logprob_codec not in LOGPROB_CODECS:
            raise ValueError(f"logprob_codec={self.logprob_codec!r}; choose one of {sorted(LOGPROB_CODECS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; choose one of {list(LAYOUTS)}")

    @property
    def kind(self) -> StoreKind:
        """The kind of store it describes (``kinds.store_kind``)."""
        return store_kind(self)

    @property
    def logprob_dtype(self) -> str:
        return LOGPROB_CODECS[self.logprob_codec].dtype

    @property
    def realised_codec(self) -> LogprobCodec:
        """The codec of ``teacher_realised_logprob``: the log-prob codec's, or :data:`REALISED_CODEC` for a grid."""
        codec = LOGPROB_CODECS[self.logprob_codec]
        return REALISED_CODEC if codec.grid is not None else codec

    @property
    def documents(self) -> bool:
        """Whether the rows are documents (a layout other than "stream"): the store holds their loss mask and
        positions."""
        return self.layout != "stream"

    @property
    def format_version(self) -> int:
        """The version a store of this spec is written in (:data:`DOCUMENTS_VERSION` for documents, else
        :data:`FORMAT_VERSION`)."""
        return DOCUMENTS_VERSION if self.documents else FORMAT_VERSION

    def described(self) -> dict[str, Any]:
        """The fields as attributes: every field, those only one kind carries (:data:`KIND_FIELDS`) only for a store
        of that kind, ``layout`` only for documents (a stream store's attributes and identity are version 5's)."""
        absent = set(KIND_FIELDS) - set(self.kind.described_fields) | ({"layout"} if not self.documents else set())
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in absent}

    @property
    def cross_tokenizer(self) -> bool:
        """Whether the store holds the arrays a student with another tokenizer needs (``vocab_bytes`` > 0)."""
        return self.vocab_bytes > 0

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.samples_per_shard)

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Samples [begin, end) of shard ``shard``."""
        begin = shard * self.samples_per_shard
        return begin, min(begin + self.samples_per_shard, self.num_samples)

    def to_attrs(self, version: int | None = None) -> dict[str, Any]:
        """The group attributes that describe the store (``complete`` and ``progress`` aside), in ``version``
        (default :attr:`format_version`)."""
        version = self.format_version if version is None else version
        attrs = dict(format=FORMAT_NAMES[self.mode], version=version, **self.described())
        return attrs | (dict(identity=store_identity(self, version)) if version >= 3 else {})

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> "CacheSpec":
        """The spec of a store's attributes; stores written before the sampled mode (no ``mode``) are top-K.

        Version 1 stores are refused: without chunk checksums their damaged or missing chunks read back as data
        (zeros), which is what version 2 exists to rule out; rewriting one takes the same cache command plus
        ``--overwrite``.
        """
        mode = attrs.get("mode", "topk")
        if attrs.get("format") not in FORMAT_NAMES.values() or attrs.get("format") != FORMAT_NAMES.get(mode):
            raise ValueError(f"not a teacher cache: format attribute {attrs.get('format')!r} with mode {mode!r}, "
                             f"expected one of {FORMAT_NAMES}")
        if attrs.get("version") == 1:
            raise ValueError("cache format version 1 (no chunk checksums) is no longer read: a damaged chunk of it "
                             "would read back as data; rewrite the store in the current version (rerun the "
                             "cache command that wrote it, plus --overwrite)")
        if attrs.get("version") not in READ_VERSIONS:
            raise ValueError(f"cache format version {attrs.get('version')!r} is not supported "
                             f"(this reader reads versions {READ_VERSIONS})")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            spec = cls(**{key: value for key, value in attrs.items() if key in names})
        except TypeError as exc:                          # a missing field, or a value of the wrong type
            raise ValueError(f"the store's attributes do not describe a cache ({exc})") from exc
        if attrs["version"] < 5 and (attrs["version"] == 4) != (spec.top_p is not None):
            raise ValueError(f"format version {attrs['version']} with top_p={spec.top_p}: version 4 is the top-p "
                             "stores' (and only theirs); the attributes were edited or the file is damaged")
        if attrs["version"] != spec.format_version and (attrs["version"] == DOCUMENTS_VERSION or spec.documents):
            raise ValueError(f"format version {attrs['version']} with layout={spec.layout!r}: version "
                             f"{DOCUMENTS_VERSION} is the documents layouts' (and only theirs); the attributes were "
                             "edited or the file is damaged")
        return spec

    def differences(self, other: "CacheSpec") -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's value)} for every field that differs."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return {key: (mine[key], theirs[key]) for key in mine if mine[key] != theirs[key]}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def store_identity(spec: CacheSpec, version: int | None = None) -> str:
    """SHA-256 (hex) of ``format``, ``version`` (default ``spec.format_version``) and every field of ``spec`` (the
    top-p ones only for a top-p store, :meth:`CacheSpec.described`): the store's identity (two stores with the same
    identity hold the same rows: every shard depends only on the settings and its samples)."""
    version = spec.format_version if version is None else version
    described = dict(format=FORMAT_NAMES[spec.mode], version=version, **spec.described())
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _blosc(typesize: int, shuffle: str = "shuffle") -> BloscCodec:
    return BloscCodec(cname="zstd", clevel=5, shuffle=shuffle, typesize=typesize)


CHUNK_KEYS = {"name": "default", "configuration": {"separator": "."}}
"""The chunk key encoding of version 5: ``c.SHARD.0.0``, one file per shard directly in the array's folder."""

CREATING = ".creating"
"""The staging folder of a store created inside an existing empty folder (see :func:`create_store`)."""


def create_store(path, spec: CacheSpec) -> None:
    """A new, empty store at ``path`` with the arrays of ``spec``, marked incomplete. ``path`` must not exist, be
    an empty folder (kept: a mount point works), or hold what a killed creation inside it left
    (:func:`interrupted_creation`, cleaned first).

    Built in a staging folder and moved into place, so a kill during creation never leaves a store without its
    attributes at ``path``: a new ``path`` is the sibling ``.NAME.creating`` renamed; an existing folder gets the
    entries of ``NAME/.creating`` renamed into it, the root zarr.json last. The staging folder is claimed by
    ``mkdir`` and locked while it is built: a leftover of a killed attempt is replaced, one that a live run is
    building is refused (ValueError). An OSError (a path that cannot be created, a full disk) names ``path`` and
    what to do, and leaves nothing behind.
    """
    if isinstance(path, storage.ObjectPrefix):
        return _create_objects(path, spec)
    path = pathlib.Path(path)
    in_place = path.is_dir() and not path.is_symlink()
    staging = path / CREATING if in_place else path.with_name(f".{path.name}.creating")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _claim(staging, path):
            if in_place:
                for entry in path.iterdir():             # a killed creation's entries (:func:`interrupted_creation`)
                    if entry.name not in (CREATING, LOCK_NAME):
                        shutil.rmtree(entry)
            _create_arrays(zarr.open_group(staging, mode="a", zarr_format=3), spec)
            if in_place:
                for entry in sorted(staging.iterdir(), key=lambda entry: entry.name == "zarr.json"):
                    if entry.name != LOCK_NAME:
                        os.rename(entry, path / entry.name)
            else:
                os.rename(staging, path)
        if in_place:
            shutil.rmtree(staging)
    except OSError as exc:
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging, ignore_errors=True)
        hint = f"free space on the file system of {path.parent} and rerun the same command" \
            if exc.errno == errno.ENOSPC else f"check that {path.parent} is a folder you can write to"
        raise OSError(exc.errno, f"cannot create the store {path}: {exc.strerror or exc}; {hint}") from exc


def _create_objects(prefix: storage.ObjectPrefix, spec: CacheSpec) -> None:
    """:func:`create_store` on object storage: the store built in memory, then written object by object, every
    array's zarr.json first and the root zarr.json (the attributes: what makes it a store) last, each one atomic PUT;
    a killed creation leaves only array zarr.json objects (:func:`interrupted_creation`), replaced by the next."""
    objects: dict = {}
    _create_arrays(zarr.open_group(zarr.storage.MemoryStore(objects), mode="w", zarr_format=3), spec)
    for key in sorted(objects, key=lambda key: (key == "zarr.json", key)):
        prefix.put(key, objects[key].to_bytes())


def interrupted_creation(path) -> bool:
    """Whether the folder ``path`` holds only what a creation inside it left when killed: its staging folder
    ``.creating`` and array folders moved out of it, no root zarr.json (on object storage: only arrays' zarr.json
    objects and the writers' lease)."""
    if isinstance(path, storage.ObjectPrefix):
        folders, objects = path.entries()
        return set(objects) <= {LOCK_NAME} and bool(folders) and all(
            name in ARRAYS and path.entries(name) == ([], ["zarr.json"]) for name in folders)
    path = pathlib.Path(path)
    if (path / "zarr.json").exists() or not (path / CREATING).is_dir() or (path / CREATING).is_symlink():
        return False
    return all(entry.name in (CREATING, LOCK_NAME) or (entry.name in ARRAYS and entry.is_dir()
                                                        and not entry.is_symlink()) for entry in path.iterdir())


def _claim(staging: pathlib.Path, path: pathlib.Path) -> WriterLock:
    """The lock of the staging folder, made by this process (see :func:`create_store`)."""
    try:
        staging.mkdir()
    except FileExistsError:
        WriterLock(staging, store=path).exclusive().release()   # ValueError if a live run builds it
        shutil.rmtree(staging)
        staging.mkdir()
    return WriterLock(staging, store=path).exclusive()


def _logprob_codecs(codec: LogprobCodec, slots: int) -> dict[str, list]:
    """The ``create_array`` codec arguments of a log-prob array of ``slots`` values per row; the chain ends with
    CRC32C."""
    if codec.grid is not None:
        step, growth, max_step, span = codec.grid
        return dict(serializer=LogprobGridZarr(slots=slots, step=step, growth=growth, max_step=max_step, span=span),
                    compressors=[_blosc(1, "noshuffle"), Crc32cCodec()])
    filters = [] if codec.keepbits is None else [numcodecs_zarr3.BitRound(keepbits=codec.keepbits)]
    return dict(filters=filters, compressors=[_blosc(np.dtype(codec.dtype).itemsize), Crc32cCodec()])


def _create_arrays(group: zarr.Group, spec: CacheSpec, version: int | None = None) -> None:
    """The arrays and attributes of ``spec`` (a store of format ``version``, default ``spec.format_version``) in the
    empty group ``group``; every chunk chain ends with CRC32C."""
    version = spec.format_version if version is None else version
    n, s, k, p = spec.num_samples, spec.seq_length, spec.k, spec.samples_per_shard
    slot = spec.kind.slot
    codec = LOGPROB_CODECS[spec.logprob_codec]
    nan = float("nan")
    create = functools.partial(group.create_array, **(dict(chunk_key_encoding=CHUNK_KEYS) if version >= 5 else {}))
    create(TOKENS, shape=(n, s + 1), chunks=(1, s + 1), shards=(p, s + 1), dtype="int32",
           compressors=[_blosc(4), Crc32cCodec()], fill_value=-1, dimension_names=("sample", "position"))
    create(IDS, shape=(n, s, k), chunks=(1, s, k), shards=(p, s, k), dtype="int32",
           filters=[numcodecs_zarr3.Delta(dtype="<i4")], compressors=[_blosc(4, codec.ids_shuffle), Crc32cCodec()],
           fill_value=-1, dimension_names=("sample", "position", slot))
    create(LOGPROBS, shape=(n, s, k), chunks=(1, s, k), shards=(p, s, k), dtype=codec.dtype,
           **_logprob_codecs(codec, k), fill_value=nan, dimension_names=("sample", "position", slot))
    for name in [LOGSUMEXP] * spec.store_logsumexp + list(spec.kind.token_arrays(spec)):
        create(name, shape=(n, s), chunks=(1, s), shards=(p, s), dtype="float32",
               compressors=[_blosc(4), Crc32cCodec()], fill_value=nan, dimension_names=("sample", "position"))
    if spec.documents:
        create(LOSS_MASK, shape=(n, s), chunks=(1, s), shards=(p, s), dtype="uint8",
               compressors=[_blosc(1), Crc32cCodec()], fill_value=255, dimension_names=("sample", "position"))
        create(POSITION_IDS, shape=(n, s), chunks=(1, s), shards=(p, s), dtype="int32",
               filters=[numcodecs_zarr3.Delta(dtype="<i4")], compressors=[_blosc(4), Crc32cCodec()], fill_value=-1,
               dimension_names=("sample", "position"))
    if spec.cross_tokenizer:
        realised = spec.realised_codec
        create(REALISED_LOGPROB, shape=(n, s), chunks=(1, s), shards=(p, s), dtype=realised.dtype,
               **_logprob_codecs(realised, 1), fill_value=nan, dimension_names=("sample", "position"))
        v = spec.vocab_size + 1
        create(VOCAB_OFFSETS, shape=(v,), chunks=(v,), dtype="int64", fill_value=-1,
               compressors=[_blosc(8), Crc32cCodec()], dimension_names=("token_id",))
        create(VOCAB_BYTES, shape=(spec.vocab_bytes,), chunks=(spec.vocab_bytes,), dtype="uint8",
               fill_value=0, compressors=[_blosc(1), Crc32cCodec()], dimension_names=("byte",))
    if version >= 3:                                     # every per-sample array above, whatever the spec adds
        with warnings.catch_warnings():                  # zarr names the lock file of a staging folder
            warnings.simplefilter("ignore", ZarrUserWarning)
            arrays = dict(group.arrays())
        bound = sorted(name for name, array in arrays.items() if array.metadata.dimension_names[:1] == ("sample",))
        create(RECORDS, shape=(n, len(bound)), chunks=(p, len(bound)), shards=(p, len(bound)), dtype="uint32",
               compressors=[Crc32cCodec()], fill_value=0, dimension_names=("sample", "array"),
               attributes=dict(arrays=bound))
    attrs = spec.to_attrs(version) | dict(complete=False)
    if version < 5:                                      # the progress marker array of the older layouts
        create(SHARD_DONE, shape=(spec.num_shards,), chunks=(1,), dtype="uint8", compressors=[Crc32cCodec()],
               fill_value=0, dimension_names=("shard",))
        attrs["progress"] = dict(shards_done=0, num_shards=spec.num_shards, samples_done=0,
                                 num_samples=spec.num_samples)
    group.attrs.update(attrs)


def _normalised(document: dict) -> dict:
    """An array's zarr.json as zarr itself writes it back (defaults filled in, one spelling per setting)."""
    metadata = ArrayV3Metadata.from_dict(dict(document))
    return json.loads(metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes())


@functools.lru_cache(maxsize=16)
def _expected_documents(spec: CacheSpec, version: int) -> dict[str, dict]:
    """{array name: :func:`_normalised` zarr.json} of the store :func:`create_store` makes for ``spec``."""
    group = zarr.open_group(zarr.storage.MemoryStore(), mode="w", zarr_format=3)
    _create_arrays(group, spec, version)
    prototype = default_buffer_prototype()
    return {name: json.loads(array.metadata.to_buffer_dict(prototype)["zarr.json"].to_bytes())
            for name, array in group.arrays()}


def sample_arrays(spec: CacheSpec, version: int | None = None) -> list[str]:
    """The arrays of the store (format ``version``, default ``spec.format_version``) with one chunk per sample (first
    dimension ``sample``), ``chunk_records`` included, sorted by name."""
    version = spec.format_version if version is None else version
    return sorted(name for name, document in _expected_documents(spec, version).items()
                  if (document.get("dimension_names") or [None])[0] == "sample")


def bound_arrays(spec: CacheSpec, version: int | None = None) -> list[str]:
    """The arrays whose chunks ``chunk_records`` binds, in its column order (none before version 3)."""
    version = spec.format_version if version is None else version
    records = _expected_documents(spec, version).get(RECORDS)
    return [] if records is None else list(records["attributes"]["arrays"])


def _differences(found, expected, where: str = "") -> list[str]:
    """Where two JSON values differ, as ``key.path: found on disk, expected implied`` texts (leaves only)."""
    if isinstance(found, dict) and isinstance(expected, dict):
        return [text for key in sorted(found.keys() | expected.keys())
                for text in _differences(found.get(key), expected.get(key), f"{where}.{key}" if where else key)]
    if isinstance(found, list) and isinstance(expected, list) and len(found) == len(expected):
        return [text for i, (a, b) in enumerate(zip(found, expected)) for text in _differences(a, b, f"{where}[{i}]")]
    return [] if found == expected else [f"{where} {found!r:.80} on disk, {expected!r:.80} implied"]


def local_path(path, what: str = "token data") -> pathlib.Path:
    """``path`` as a local path; ValueError (one line) for a URL (``storage.location`` takes stores on object
    storage; ``pathlib`` would fold ``s3://bucket/x`` into a local folder named ``s3:``)."""
    if storage.location(path, what) != storage.LocalFolder(pathlib.Path(path)):
        raise ValueError(f"{os.fspath(path)}: {what} on object storage is not supported; copy it to a local or "
                         "mounted file system and pass that path")
    return pathlib.Path(path)


def store_location(path) -> "pathlib.Path | storage.ObjectPrefix":
    """A store's place: a local path, or an :class:`storage.ObjectPrefix` for ``s3://`` and ``msc://`` URLs;
    ValueError (one line) for a URL of another scheme."""
    where = storage.location(path)
    return where.path if isinstance(where, storage.LocalFolder) else where


def files_of(path) -> "storage.LocalFolder | storage.ObjectPrefix":
    """The files of the store at ``path`` (a local path or an object prefix), read through one interface."""
    return path if isinstance(path, storage.ObjectPrefix) else storage.LocalFolder(pathlib.Path(path))


def open_group(path, mode: str = "r") -> zarr.Group:
    """The zarr group of the store at ``path`` (a local path or an :class:`storage.ObjectPrefix`)."""
    if isinstance(path, storage.ObjectPrefix):
        return zarr.open_group(path.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3)
    return zarr.open_group(path, mode=mode)


def _documents(path) -> dict:
    """{array name ("" for the group): its zarr.json, parsed} of the store at ``path``."""
    documents = {}
    if isinstance(path, storage.ObjectPrefix):
        files = [(name, f"{name}/zarr.json" if name else "zarr.json") for name in [""] + path.folders()]
        read = path.get
    else:
        files = [("", "zarr.json")] + [(file.parent.name, f"{file.parent.name}/zarr.json")
                                       for file in sorted(path.glob("*/zarr.json"))]
        read = lambda key: (path / key).read_bytes()
    for name, key in files:                              # (a folder without a zarr.json is no array: skipped)
        try:
            data = read(key)
        except FileNotFoundError:
            if name == "":
                raise ValueError(f"{path} is not a teacher cache (no zarr.json)") from None
            continue
        try:
            documents[name] = json.loads(data)
        except ValueError as exc:                        # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{files_of(path).name(key)} is damaged (not valid JSON: {exc}); the store's metadata "
                             "cannot be repaired: rewrite the store (rerun the cache command that wrote it, plus "
                             "--overwrite)") from exc
    return documents


def open_store(path, mode: str = "r") -> tuple[zarr.Group, CacheSpec]:
    """(group, spec) of the store at ``path``, after checking its metadata; ValueError saying what is wrong.

    Every zarr.json must parse, the attributes must describe a cache of a readable format version, their
    ``identity`` (version 3) must be their SHA-256 (:func:`store_identity`), and each array's whole zarr.json
    (normalised by zarr: :func:`_normalised`) must be what :func:`create_store` writes for those attributes: an
    attribute or a codec setting edited against the arrays is refused here instead of serving wrong rows.
    """
    path = store_location(path)
    documents = _documents(path)
    root = documents.pop("")
    if not isinstance(root, dict) or root.get("node_type") != "group" or root.get("zarr_format") != 3:
        raise ValueError(f"{files_of(path).name('zarr.json')} is not the metadata of a zarr v3 group: {path} is not a teacher cache")
    attrs = root.get("attributes") if isinstance(root.get("attributes"), dict) else {}
    try:
        spec = CacheSpec.from_attrs(attrs)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    version = attrs["version"]
    if version >= 3 and attrs.get("identity") != store_identity(spec, version):
        raise ValueError(f"{files_of(path).name('zarr.json')}: the attributes that decide how rows are read and trained on do not "
                         f"match their checksum (identity {attrs.get('identity')!r} stored, "
                         f"{store_identity(spec, version)!r} computed from format, version and "
                         f"{', '.join(f.name for f in dataclasses.fields(CacheSpec))}): the attributes were edited "
                         "or the file is damaged; rewrite the store (rerun the cache command that wrote it, plus "
                         "--overwrite)")
    expected = _expected_documents(spec, version)
    implied = (f"k={spec.k}, seq_length={spec.seq_length}, num_samples={spec.num_samples}, "
               f"samples_per_shard={spec.samples_per_shard}, mode={spec.mode!r}, logprob_codec={spec.logprob_codec!r}"
               f", store_logsumexp={spec.store_logsumexp}, vocab_bytes={spec.vocab_bytes}, layout={spec.layout!r}, "
               f"version={version}")
    for name in sorted(expected.keys() | documents.keys()):
        if name not in documents or name not in expected:
            where = "is missing" if name not in documents else "should not exist"
            raise ValueError(f"{path}: the array {name} {where} for the store's attributes ({implied}): the store's "
                             "zarr.json was edited or the store is damaged")
        file = files_of(path).name(f"{name}/zarr.json")
        try:
            found = _normalised(documents[name])
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{file} is damaged (not the metadata of a zarr v3 array: {exc})") from exc
        listed = _differences(found, expected[name])
        if listed:
            raise ValueError(f"{file}: the attributes ({implied}) do not match the array {name} ("
                             f"{'; '.join(listed[:6])}): the store's zarr.json was edited or the store is damaged")
    return open_group(path, mode), spec


class ShardFiles:
    """The files of the shards of the store at ``path`` (a local path or an object prefix, opened as ``group``,
    ``spec``): which shards are written, which of their files are missing, and deleting one so that a writer redoes
    it.

    Version 5: a shard is written when its ``chunk_records`` file exists (written after the shard's data, by an
    atomic rename or one PUT); versions 2 to 4: when its ``shard_done`` element is 1. On a local disk every check
    stats only the files of the shards asked about, so each writer rank checks its own shards in time proportional
    to their number, whatever the size of the store; on object storage one listing of an array's folder answers for
    all its shards (N/P keys).
    """

    def __init__(self, path, group: zarr.Group, spec: CacheSpec):
        self.path, self.spec, self.version = store_location(path), spec, group.attrs["version"]
        self.files = files_of(self.path)
        self.arrays = {name: group[name].metadata for name in sample_arrays(spec, self.version)}
        self._markers = group[SHARD_DONE] if self.version < 5 else None
        self._listed: dict[str, set[str]] = {}

    def file(self, name: str, shard: int) -> str:
        """The file (or object) of array ``name`` that holds shard ``shard``, as a text naming it."""
        return self.files.name(self._key(name, shard))

    def _key(self, name: str, shard: int) -> str:
        metadata = self.arrays[name]
        return f"{name}/{metadata.encode_chunk_key((int(shard),) + (0,) * (len(metadata.shape) - 1))}"

    def _exists(self, name: str, shard: int) -> bool:
        if isinstance(self.files, storage.LocalFolder):
            return self.files.exists(self._key(name, shard))
        if name not in self._listed:
            self._listed[name] = set(self.files.keys(f"{name}/"))
        return self._key(name, shard) in self._listed[name]

    def written(self, shards=None) -> list[int]:
        """The shards of ``shards`` (default: all) that are completely written, ascending."""
        shards = range(self.spec.num_shards) if shards is None else shards
        if self._markers is not None:
            done = self._markers[:]
            return [int(shard) for shard in shards if done[shard]]
        return [int(shard) for shard in shards if self._exists(RECORDS, shard)]

    def missing_files(self, shards=None) -> list[str]:
        """The files of the written shards among ``shards`` (default: all) that do not exist, as texts naming each
        with its samples."""
        missing = []
        for shard in self.written(shards):
            for name in self.arrays:
                if not self._exists(name, shard):
                    begin, end = self.spec.shard_range(shard)
                    missing.append(f"{self.file(name, shard)} (samples [{begin}, {end}))")
        return missing

    def missing_samples(self) -> list[tuple[int, int]]:
        """Sample ranges [begin, end) whose shard is not written, merged."""
        written = set(self.written())
        ranges: list[tuple[int, int]] = []
        for shard in range(self.spec.num_shards):
            if shard in written:
                continue
            begin, end = self.spec.shard_range(shard)
            if ranges and ranges[-1][1] == begin:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((begin, end))
        return ranges

    def unwrite(self, shard: int) -> None:
        """Deletes shard ``shard``'s files, its records first, so that it reads as not written at every moment and a
        writer redoes it (version 5 stores; older ones are rewritten whole)."""
        if self._markers is not None:
            raise ValueError(f"{self.path} is a store of format version {self.version}; only version {FORMAT_VERSION} "
                             "stores are rewritten shard by shard")
        self._listed.clear()
        for name in [RECORDS] + [name for name in self.arrays if name != RECORDS]:
            if isinstance(self.files, storage.LocalFolder):
                (self.files.path / self._key(name, shard)).unlink(missing_ok=True)
            else:
                self.files.delete(self._key(name, shard))


def open_finished_store(path) -> tuple[zarr.Group, CacheSpec]:
    """:func:`open_store` of a finished store (attribute ``complete``); ValueError naming the samples not written of
    an unfinished one."""
    path = store_location(path)
    group, spec = open_store(path)
    if group.attrs.get("complete") is not True:
        missing = ShardFiles(path, group, spec).missing_samples()
        raise ValueError(f"{path} is unfinished: samples {describe_ranges(missing)} of {spec.num_samples} are not "
                         "written; rerun the cache tool with the same command to complete it")
    return group, spec


_PARTIAL = re.compile(r"\.[0-9a-f]{32}\.partial$")
"""The suffix of zarr LocalStore's temporary files (``NAME.<uuid>.partial``, renamed to NAME once written)."""
_CHUNK = re.compile(r"[0-9]+$")
_DOT_CHUNK = re.compile(r"c(\.[0-9]+)*$")
"""A chunk file of version 5 (``c.12.0.0``), or what zarr's temporary of one is named after (``c.12.0``)."""


def _store_file(parts: tuple[str, ...]) -> bool:
    """Whether the path ``parts`` (relative to a store's root) is a file this project's stores hold."""
    partial = _PARTIAL.search(parts[-1])
    name = parts[-1][:partial.start()] if partial else parts[-1]
    metadata = parts[-1] == "zarr.json" or (partial is not None and name == "zarr")   # zarr.<uuid>.partial
    if len(parts) == 1:
        return metadata or parts[0] == LOCK_NAME
    if parts[0] not in ARRAYS:
        return False
    if len(parts) == 2:
        return metadata or _DOT_CHUNK.match(name) is not None
    return parts[1] == "c" and all(_CHUNK.match(part) for part in parts[2:-1] + (name,))


def foreign_entries(path, deep: bool = True, named: bool = True) -> list[str]:
    """What in the folder ``path`` is not part of a store of this project (empty: all of it is), as short texts.

    A store of this project is known by its own root zarr.json naming one of :data:`FORMAT_NAMES` (a folder that
    merely looks like a store's layout is not one, nor one whose zarr.json does not parse), and holds only its
    zarr.json files, chunk files (``ARRAY/c.N.0`` and, before version 5, under ``ARRAY/c/``), zarr's temporaries and
    its lock file. Symbolic links are never part of one. ``deep``: every file of every array folder is checked (what
    deleting the store needs); otherwise only the store's root and its array folders themselves (what writing its
    own chunk files into it needs: constant time, whatever the size of the store). ``named``: a root zarr.json
    naming this tool's format is required (without: only the layout is checked, what an interrupted copy holds).
    """
    if isinstance(path, storage.ObjectPrefix):
        return _foreign_objects(path, deep, named)
    path = pathlib.Path(path)
    if path.is_symlink() or not path.is_dir():
        return [f"{path} is {'a symbolic link' if path.is_symlink() else 'not a folder'}"]
    foreign = []
    for folder, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            entry = pathlib.Path(folder, name)
            parts = entry.relative_to(path).parts
            if entry.is_symlink():
                foreign.append(f"{entry} is a symbolic link")
            elif entry.is_dir():
                if not (parts[0] in ARRAYS and (len(parts) == 1 or parts[1] == "c" and
                                                all(_CHUNK.match(part) for part in parts[2:]))):
                    foreign.append(f"it holds the folder {entry}")
                    dirs.remove(name)                    # do not walk what is not ours
            elif not _store_file(parts):
                foreign.append(f"it holds the file {entry}")
        if not deep:
            break
    return foreign + (_foreign_format(lambda: (path / "zarr.json").read_bytes()) if named else [])


def _foreign_objects(prefix: storage.ObjectPrefix, deep: bool, named: bool) -> list[str]:
    """:func:`foreign_entries` of an object prefix: its keys (``deep``: all of them; else one level) against a
    store's."""
    if deep:
        keys = [tuple(key.split("/")) for key in prefix.keys()]
    else:
        folders, objects = prefix.entries()
        keys = [(name,) for name in objects] + [(name, "zarr.json") for name in folders]
    foreign = [f"it holds the object {prefix.name('/'.join(parts))}" for parts in keys
               if not (_store_file(parts) and not any(is_partial(pathlib.Path(part)) for part in parts))]
    return foreign + (_foreign_format(lambda: prefix.get("zarr.json")) if named else [])


def _foreign_format(read) -> list[str]:
    """[] when ``read()`` (a store's root zarr.json) names this tool's format, else what it is."""
    foreign = []
    try:
        document = json.loads(read())
    except FileNotFoundError:
        foreign.append("it has no zarr.json naming this tool's format")
    except (ValueError, OSError) as exc:
        foreign.append(f"its zarr.json does not parse ({exc}); if it is a damaged store of this tool, remove it "
                       "yourself")
    else:
        attributes = document.get("attributes") if isinstance(document, dict) else None
        found = attributes.get("format") if isinstance(attributes, dict) else None
        if found not in FORMAT_NAMES.values():
            foreign.append(f"its zarr.json names the format {found!r}, not one of {sorted(FORMAT_NAMES.values())}")
    return foreign


def is_partial(path: pathlib.Path) -> bool:
    """Whether ``path`` is one of zarr LocalStore's temporaries."""
    return _PARTIAL.search(path.name) is not None


def remove_partials(path) -> int:
    """Deletes the temporaries a kill left in the store at ``path`` (between zarr's write and rename); their count.

    Call only while no process writes the store's chunks (every writer finished, or the writers' lock held
    exclusively). Object storage has no temporaries (a PUT is atomic).
    """
    if isinstance(path, storage.ObjectPrefix):
        return 0
    partials = [file for file in pathlib.Path(path).rglob("*.partial") if is_partial(file)
                and _store_file(file.relative_to(path).parts)]
    for file in partials:
        file.unlink()
    return len(partials)


def describe_ranges(ranges: list[tuple[int, int]], limit: int = 5) -> str:
    text = ", ".join(f"[{b}, {e})" for b, e in ranges[:limit])
    return text + (f" and {len(ranges) - limit} more ranges" if len(ranges) > limit else "")
