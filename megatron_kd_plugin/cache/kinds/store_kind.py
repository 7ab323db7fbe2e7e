"""What one kind of teacher store is: the interface every kind (``kinds/``) implements, and the one place the
writer, the reader, ``inspect`` and the cache command learn what a store holds per token.

A kind owns, for its stores: which :class:`~megatron_kd_plugin.cache.store.format.CacheSpec` fields it sets and checks
(``fields``, ``check``), the arrays it adds (``token_arrays``), its log-prob codec (``default_codec``,
``grid_codec``), how a block of tokens' rows are computed from the teacher's vocab-parallel logits (``teacher_rows``, fed
block by block by the fused head, ``teacher_head.py``) and what work buffers that takes (``work_bytes_per_logit``), how a
row read back becomes the loss's typed teacher (``teacher``) and which loss tails fit it (``check_tail``), and its
``inspect`` lines (``describe``, ``statistics``). It never imports the store's schema (``format.py`` imports the
registry), only the array names.

A kind's module is the store's description and imports no torch: reading, copying and verifying a store (``format.py``,
``records.py``, ``store_copy.py``) never load it. What computes with torch, the rows from the logits and the loss's
typed teacher, lives in the math modules (``topk.py``, ``draws.py``, ``head_draws.py``) and ``megatron_kd_plugin.loss``,
which the methods that compute (``teacher_rows``, ``weights``, ``teacher_type``) import when they are called.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_kd_plugin.cache.store.array_names import IDS, LOGPROBS

if TYPE_CHECKING:
    import torch

    from megatron_kd_plugin.loss import KDLossOptions


class StoreKind(abc.ABC):
    """One kind of teacher store (module docstring). ``spec`` arguments are a ``format.CacheSpec`` (or anything with
    its fields, such as the cache command's parsed arguments for :meth:`holds`)."""

    name: str
    """What users call it, in messages and ``inspect`` ("top-K", "head + draws", ...)."""
    mode: str
    """The ``CacheSpec.mode`` of its stores: ``topk`` (slots are the teacher's most probable ids) or ``sampled``
    (slots are draws); the store's ``format`` attribute follows it."""
    fields: Mapping[str, Any] = {}
    """The ``CacheSpec`` fields that only its stores set, with the value every other store has."""
    described_fields: tuple[str, ...] = ()
    """Those of ``fields`` that only its stores' attributes (and identity) carry."""
    slot: str
    """The name of the slot dimension of its per-token arrays (``rank`` or ``draw``)."""
    default_codec: str
    """Its log-prob codec unless the run chooses one (a key of ``format.LOGPROB_CODECS``)."""
    grid_codec: bool
    """Whether a log-prob grid codec can store its rows (a grid's mass balance is a top-K row's)."""
    exact_slots: bool
    """Whether its slots are the teacher's most probable ids (a cross-tokenizer student's token term reads them)."""
    work_bytes_per_logit: int
    """Peak bytes of :meth:`teacher_rows`' work buffers per logit of its block, beside the logits (the head's block
    budget and ``plan`` count them)."""

    @abc.abstractmethod
    def holds(self, spec) -> bool:
        """Whether ``spec`` describes a store of this kind (the registry asks the kinds in order)."""

    def defaults(self, spec) -> dict[str, Any]:
        """Fields of ``spec`` left unset that this kind fills in ({field: value}; default: none)."""
        return {}

    def check(self, spec) -> None:
        """ValueError, in one line naming the setting, unless ``spec``'s fields make a store of this kind."""

    def token_arrays(self, spec) -> tuple[str, ...]:
        """The float32 [samples, S] arrays its stores hold besides the ids and log-probs (default: none)."""
        return ()

    @property
    @abc.abstractmethod
    def teacher_type(self) -> type:
        """The loss's typed teacher its rows carry (``loss.TopKTeacher`` or ``loss.SampledTeacher``)."""

    @abc.abstractmethod
    def teacher_rows(self, logits: torch.Tensor, spec, *, block, tp_group
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({array name: ``[p, n, ...]`` rows}, finite ``[p, n]``) of a block of vocab-parallel logits ``[p, n, V/tp]``
        (``block``: a ``teacher_head.TokenBlock``, where its first token lies): the ids (sorted as ``format.py``
        says), their log-probs, the full-vocab logsumexp ``[p, n]`` and :meth:`token_arrays`. Per token: a block's
        rows are the rows of the same tokens of any larger block."""

    def weights(self, spec, rows: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The slots' importance weights ``[..., K]`` computed from its stored ``rows`` (decoded log-probs and
        :meth:`token_arrays`), as a one-tuple; () for slots that are the teacher's own ids (no weights)."""
        return ()

    def teacher(self, spec, rows: Mapping[str, torch.Tensor]):
        """The loss's typed teacher (``teacher_type``) of stored ``rows`` ``[..., K]``."""
        return self.teacher_type(rows[IDS], rows[LOGPROBS], *self.weights(spec, rows))

    def check_tail(self, options: KDLossOptions, where: str) -> None:
        """ValueError, in one line naming the setting to change, for a ``kd.tail`` its rows cannot serve (``where``:
        the store's path): their teacher type decides."""
        self.teacher_type.check_tail(options.tail, f"the {self.name} store {where}")

    @abc.abstractmethod
    def describe(self, spec) -> str:
        """One line: what a store of ``spec`` holds per token (``inspect``, the cache command's summary)."""

    @abc.abstractmethod
    def statistics(self, ids: np.ndarray, logprobs: np.ndarray) -> dict[str, np.ndarray]:
        """{name: per-token values} of stored rows ``[..., K]`` that ``inspect`` summarises."""
