"""Megatron-Bridge dataset provider over teacher cache stores (``cfg.dataset`` of a KD run): one store, a blend of
stores with weights, or an ensemble of teachers over the same samples.

    cfg.dataset = TopKCacheDatasetProvider(cache_path="cache.zarr", seq_length=4096)
    cfg.dataset = TopKCacheDatasetProvider(blend="0.7 code.zarr 0.3 prose.zarr", seq_length=4096)   # --data-path
    cfg.dataset = TopKCacheDatasetProvider(blend_per_split=["0.5 a.zarr 0.5 b.zarr", "c.zarr", None], ...)
    cfg.dataset = TopKCacheDatasetProvider(ensemble="0.5 general.zarr 0.5 code_expert.zarr", ...)

Bridge calls ``build_datasets(context)`` during setup with the sample counts its samplers will draw; a split of one
source is a ``cache.KDRows`` over the rows of the store's kind (``cache.row_kind``: top-K, sampled, or, with a
``student_tokenizer`` of another identity than the store's tokenizer, cross-tokenizer rows), a split of several a
``cache.BlendedRows`` (megatron-core's blending order), so resuming at ``consumed_samples`` keeps rows aligned under
any DP size. Every store is checked before step one (``row_kinds``, through ``check_kd_config``): finished, K as
expected, its ids inside the student's vocabulary, its seq_length a multiple of the student's (cross-tokenizer rows:
the student tokenizer inside the student's vocabulary), and the stores of a run together (``cache.check_blend``: one
kind of teacher rows, one tokenizer). Each row carries the index of its source among ``source_names``; with more
than one source the loss reports each source's figures (``kd loss [NAME]``).
"""

from __future__ import annotations

import dataclasses
import pathlib

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.core.datasets.blended_megatron_dataset_config import (
                                                                    convert_split_vector_to_split_matrix,
                                                                    parse_and_normalize_split,
                                                                    )
from megatron.core.datasets.utils import get_blend_from_list

from megatron_kd_plugin.cache import (
                                      BlendedRows,
                                      EnsembleRows,
                                      KDRows,
                                      RankRows,
                                      RowKind,
                                      TokenBytes,
                                      TopKCacheReader,
                                      check_blend,
                                      row_kind,
                                      )

SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "100,0,0"


@dataclasses.dataclass(frozen=True)
class EnsembleSource:
    """The one source of an ensemble run: its stores and their weights; each row mixes the members' teachers over the
    same sample (``cache.rows.ensemble_rows``). A run's other sources are store paths (``str``)."""

    members: tuple[tuple[str, float], ...]

    @property
    def name(self) -> str:
        """The members' folder names without ``.zarr``, joined by ``+``."""
        return "+".join(pathlib.Path(path).stem for path, _ in self.members)

    def described(self) -> dict:
        """What identifies it in a run's data identity (``data_identity``)."""
        return {"ensemble": [list(member) for member in self.members]}


Source = str | EnsembleSource
"""One source of a run's rows: a store path, or an ensemble of stores."""


def parse_blend(value, what: str) -> list[tuple[str, float | None]]:
    """A blend as Megatron writes one (``"0.7 a.zarr 0.3 b.zarr"``, ``"a.zarr b.zarr"``, or the same as a list of
    strings) -> [(path, weight or None)], entries of weight 0 dropped; ValueError naming ``what`` if malformed."""
    items = value.split() if isinstance(value, str) else [str(item) for item in value]
    if not items:
        raise ValueError(f"{what}={value!r}: empty; expected 'WEIGHT PATH WEIGHT PATH ...' or 'PATH PATH ...'")
    try:
        paths, weights = get_blend_from_list(items)
    except (AssertionError, ValueError):
        paths, weights = None, None
    if paths is None or (weights is None and any(_numbers([item]) for item in items)):
        raise ValueError(f"{what}={value!r}: expected 'WEIGHT PATH WEIGHT PATH ...' (Megatron's --data-path) or "
                         "'PATH PATH ...'")
    if weights is None:
        return [(path, None) for path in paths]
    if any(not weight >= 0 for weight in weights) or not sum(weights) > 0:
        raise ValueError(f"{what}={value!r}: weights must be >= 0 and not all 0")
    return [(path, float(weight)) for path, weight in zip(paths, weights) if weight > 0]


def _numbers(items) -> bool:
    try:
        [float(item) for item in items]
    except ValueError:
        return False
    return True


@dataclasses.dataclass(kw_only=True)
class TopKCacheDatasetProvider(DatasetProvider):
    """Train/valid/test datasets of student rows read from teacher cache stores (module docstring)."""

    cache_path: str | None = None
    """Path of the finished cache store (written by ``megatron_kd_plugin.cache``) when the run reads one store; a
    ``blend``, ``blend_per_split`` or ``ensemble`` takes its place."""

    blend: str | list[str] | None = None
    """Several stores with weights, as Megatron's ``--data-path``: ``"0.7 code.zarr 0.3 prose.zarr"`` (or the same
    as a list of strings; without weights, ``"a.zarr b.zarr"``, each store weighs its rows: a concatenation, e.g.
    of stores written by separate cache jobs over disjoint data). Every split draws from every store, each store cut
    by ``split``; weights are normalised, an entry of weight 0 is left out."""

    blend_per_split: list[str | list[str] | None] | None = None
    """One blend per split, [train, valid, test] (Megatron's ``blend_per_split``; None: no such split), each store
    read whole (``split`` must stay at its default)."""

    ensemble: str | list[str] | None = None
    """Teachers cached over the same samples, mixed per token (``cache.rows.ensemble_rows``): ``"0.5 general.zarr 0.5
    code_expert.zarr"`` (without weights: equal); top-K stores of one tokenizer whose tokens agree sample for sample.
    Cut by ``split``; it takes the place of ``cache_path`` and cannot be combined with a blend."""

    seq_length: int
    """Student sequence length; must divide the cache's seq_length (one cached sample = several student rows), and
    equal it for a store of packed or per-document rows (read whole: a window would cut their documents)."""

    k: int | None = None
    """Expected top-K of every store; None accepts each store's K."""

    split: str = DEFAULT_SPLIT
    """Megatron-style train,valid,test weights over each store's cached samples (contiguous ranges, no sample
    shared)."""

    seed: int = 1234
    """Shuffling seed (also the seed Bridge's batch sampler reads from ``cfg.dataset.seed``)."""

    shuffle: bool = True
    """Visit each epoch's windows in a seeded random order; False: cache order."""

    dataloader_type: str | None = "single"
    """Megatron sampler: ``single`` (sequential over rows, resumable by consumed samples) or ``cyclic``."""

    micro_batch_size: int | None = None
    """Not a setting: ``cfg.train.micro_batch_size``, copied here by ``KDConfigContainer.validate`` (any value given
    is replaced) so that each data-parallel rank's read-ahead (object storage) fetches the rows ``single``'s sampler
    gives that rank and no other rank's (``cache.rows.rank_rows``). None: every row's samples are hinted."""

    eval_micro_batch_size: int | None = None
    """Not a setting: the validation and test micro-batch size (``cfg.validation.eval_micro_batch_size``, else the
    training one), copied as ``micro_batch_size``."""

    student_tokenizer: str | None = None
    """The student's tokenizer (a tokenizer.json, or a folder holding one: its HF tokenizer or checkpoint folder)
    when it differs from the teacher's: the rows are then re-tokenised and aligned (cross-tokenizer distillation,
    ``cache.rows.cross_tokenizer_rows``; seq_length need not divide the cache's; one store). None, or the store's own
    tokenizer: the teacher's tokens and top-K as they are."""

    student_alignments: str = "sidecar"
    """Cross-tokenizer rows: where each cached sample's student tokenization and segments come from
    (``cache.cross_tokenizer.student_alignments``). ``sidecar``: the folder ``<store>.align-<tokenizer hash>`` beside
    the store, memory-mapped (one copy per machine in the page cache), or, when absent or of another store/tokenizer,
    computed for the whole store (batch encode, a progress bar) before step one by the first process to take its lock,
    written there atomically while the others wait, then mapped (where the folder is read-only: computed on first use
    and kept in memory, with a warning); ``memory``: computed on each sample's first read and kept in memory."""

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
        self.blends()

    def blends(self) -> list[list[tuple[Source, float | None]] | None]:
        """Each split's sources and their weights, [train, valid, test] (None: no such split): a source is a store
        path, or the ensemble (``EnsembleSource``). ValueError for settings that name no data or contradict each
        other."""
        given = [name for name in ("blend", "blend_per_split", "ensemble") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"dataset.{' and dataset.'.join(given)} are both set: a run reads a blend, one blend per "
                             "split, or an ensemble")
        if self.blend_per_split is not None:
            if len(self.blend_per_split) != len(SPLITS):
                raise ValueError(f"dataset.blend_per_split has {len(self.blend_per_split)} entries: expected one blend "
                                 f"(or None) per split {SPLITS}")
            if self.split != DEFAULT_SPLIT:
                raise ValueError(f"dataset.split={self.split!r} with dataset.blend_per_split: each split's stores are "
                                 "read whole; leave dataset.split at its default")
            return [None if value is None else parse_blend(value, f"dataset.blend_per_split[{index}]")
                    for index, value in enumerate(self.blend_per_split)]
        if self.ensemble is not None:
            entries = [(EnsembleSource(tuple(self.ensemble_members())), None)]
        elif self.blend is not None:
            entries = parse_blend(self.blend, "dataset.blend")
        elif self.cache_path is not None:
            entries = [(self.cache_path, None)]
        else:
            raise ValueError("dataset: no data: set dataset.cache_path (one store), dataset.blend, "
                             "dataset.blend_per_split or dataset.ensemble")
        return [entries] * len(SPLITS)

    def ensemble_members(self) -> list[tuple[str, float]]:
        """The ensemble's stores and their weights (equal when not given)."""
        members = parse_blend(self.ensemble, "dataset.ensemble")
        if len(members) < 2:
            raise ValueError(f"dataset.ensemble={self.ensemble!r}: an ensemble mixes two or more stores")
        return [(path, 1.0 if weight is None else weight) for path, weight in members]

    def sources(self) -> list[Source]:
        """Every source the splits read, in order of first appearance: a row's ``source`` indexes this list."""
        seen = {}
        for entries in self.blends():
            for key, _ in entries or ():
                seen.setdefault(key, None)
        return list(seen)

    @property
    def source_names(self) -> tuple[str, ...]:
        """Names of ``sources()`` for the per-source figures (a store's folder name without ``.zarr``; the ensemble's
        stores' joined by ``+``); () for a run of one source (its figures are the run's)."""
        sources = self.sources()
        if len(sources) < 2:
            return ()
        names = [source.name if isinstance(source, EnsembleSource) else pathlib.Path(source).stem
                 for source in sources]
        return tuple(names) if len(set(names)) == len(names) else tuple(map(str, sources))

    def _open(self, path: str, vocab_size: int | None) -> RowKind:
        reader = TopKCacheReader(path)   # refuses an unfinished store
        student = None if self.student_tokenizer is None else TokenBytes.load(self.student_tokenizer)
        kind = row_kind(reader, seq_length=self.seq_length, student=student, alignments=self.student_alignments)
        kind.validate(vocab_size=vocab_size, k=self.k)
        return kind

    def row_kinds(self, *, vocab_size: int | None = None) -> dict[Source, RowKind]:
        """Every source opened and its rows' kind looked up for this student ({source: kind}, ``sources()``'s
        order), checked against this provider, the student's ``vocab_size`` (if given; ``check_kd_config`` passes
        the model's) and each other (``cache.check_blend``); ValueError if they do not fit."""
        kinds = {}
        for key in self.sources():
            if isinstance(key, EnsembleSource):
                kinds[key] = EnsembleRows([self._open(path, vocab_size) for path, _ in key.members],
                                          [weight for _, weight in key.members])
            else:
                kinds[key] = self._open(key, vocab_size)
        check_blend(kinds)
        return kinds

    def data_identity(self) -> dict:
        """What decides the order of the training rows besides the stores' contents: each split's sources and
        weights (the ensemble's stores and weights), the split, seed and shuffling, the student's seq_length. A run
        resumes only on the same (``bridge.resume``)."""
        described = [None if entries is None else
                     [(source.described() if isinstance(source, EnsembleSource) else source, weight)
                      for source, weight in entries] for entries in self.blends()]
        identity = {"splits": dict(zip(SPLITS, described)),
                    "split": None if self.blend_per_split is not None else self.split, "seed": self.seed,
                    "shuffle": self.shuffle, "seq_length": self.seq_length}
        return identity

    def build_datasets(self, context: DatasetBuildContext):
        """(train, valid, test) datasets with the sample counts Bridge asks for (None if 0 or no such split)."""
        kinds = self.row_kinds()
        for kind in kinds.values():
            kind.prepare()
        keys = list(kinds)
        counts = (context.train_samples, context.valid_samples, context.test_samples)
        datasets = []
        for index, (entries, rows) in enumerate(zip(self.blends(), counts)):
            if entries is None or not rows:
                datasets.append(None)
                continue
            parts = [(kinds[key], self._sample_ids(kinds[key], index), keys.index(key)) for key, _ in entries]
            empty = [key for (key, _), (_, ids, _) in zip(entries, parts) if ids is None or len(ids) == 0]
            if parts[0][1] is None or (index and len(empty) == len(parts)):
                datasets.append(None)   # a split of weight 0, an empty eval split: Bridge then skips evaluation
                continue
            if empty and len(parts) > 1:
                raise ValueError(f"the {SPLITS[index]} split of dataset.split={self.split!r} holds no cached samples "
                                 f"of {', '.join(empty)}; change the split, the blend or write larger stores")
            seed = self.seed + index
            reads = self._reads(rows, self.micro_batch_size if index == 0 else self.eval_micro_batch_size)
            if len(parts) == 1:
                kind, sample_ids, source = parts[0]
                datasets.append(KDRows(kind, sample_ids, num_rows=rows, seed=seed, shuffle=self.shuffle,
                                       source=source, reads=reads, read_ahead=self.dataloader_type == "single"))
            else:
                datasets.append(BlendedRows(parts, [weight for _, weight in entries]
                                            if entries[0][1] is not None else None,
                                            num_rows=rows, seed=seed, shuffle=self.shuffle, reads=reads,
                                            read_ahead=self.dataloader_type == "single"))
        return tuple(datasets)

    def _reads(self, num_rows: int, micro_batch_size: int | None) -> RankRows | None:
        """The rows of a ``num_rows``-row split this data-parallel rank reads (megatron-core's data-parallel group,
        the one Bridge's samplers deal rows over); None (every row) without a micro-batch size or parallel state."""
        from megatron.core import parallel_state

        if micro_batch_size is None or not parallel_state.model_parallel_is_initialized():
            return None
        return RankRows(parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                        micro_batch_size, num_rows=num_rows, drop_last=self.drop_last)

    def _sample_ids(self, kind: RowKind, split: int) -> range | None:
        """The cached samples of split ``split`` in ``kind``'s store: all of them with ``blend_per_split``, else the
        split's contiguous range (None: ``split`` gives the split weight 0); a ``range``, nothing per sample."""
        n = kind.num_samples()
        if self.blend_per_split is not None:
            return range(n)
        bound = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))[split]
        return None if bound is None else range(int(round(bound[0] * n)), int(round(bound[1] * n)))
