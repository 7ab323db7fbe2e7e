"""An ensemble of teachers: top-K stores cached from different teachers over the same samples, mixed per token.

The math, once. Teachers j = 1..J with weights pi_j > 0 (normalised to sum 1) cached the same samples (the same
layout; the same tokens, loss masks and positions, checked on every read); per token teacher j holds ids I_j [K_j]
and log-probs l_j [K_j] over its full vocabulary (-inf: a padding slot of a top-p store), its top-K mass
m_j = sum_k exp(l_jk) <= 1, and the rest of its distribution p_j, 1 - m_j, is unknown (its tail). The ensemble's
teacher is the mixture p = sum_j pi_j p_j as far as the stores know it, on the union U = I_1 u ... u I_J of the ids:

    P(v) = sum_j pi_j exp(l_j(v)) [v in I_j]                  for v in U     (a teacher that did not keep v adds 0)
    1 - sum_{v in U} P(v) = sum_j pi_j (1 - m_j)                             (the mass outside: each teacher's tail)

so what teacher j gives an id of U it did not keep stays in its tail bucket: P <= p on U and the outside mass >= p's
mass outside U, with equality when every teacher holds its whole vocabulary (K_j = V: P = p exactly). As K slots
this is a ``loss.TopKTeacher`` of the J rows side by side,

    ids = [I_1, ..., I_J]   logprobs = [l_1 + log pi_1, ..., l_J + log pi_J]        [S, K_1 + ... + K_J]

whose repeated ids the top-K loss merges into one bucket by adding their probabilities (``loss.teacher``'s
``merge_duplicate_ids``): that sum is P(v), and its ghost tail 1 - sum of the slots is sum_j pi_j (1 - m_j). Every
tail and divergence of the top-K loss then applies unchanged to the mixture (``ghost``: the |U| + 1 buckets above;
``none``; ``renorm``: P / P(U)), at the loss cost of K_1 + ... + K_J slots per token. Sampled stores cannot join
(their draws' importance weights estimate one teacher), nor stores of another cache temperature.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from megatron_kd_plugin.cache.rows.kd_rows import KDRow, RowKind
from megatron_kd_plugin.loss import KDLossOptions, TopKTeacher


def mixture_teacher(teachers: Sequence[TopKTeacher], weights: Sequence[float]) -> TopKTeacher:
    """The mixture of ``teachers`` (each [..., K_j] over the same tokens) with ``weights`` (> 0, normalised here)
    as one ``TopKTeacher`` [..., K_1 + ... + K_J] (module docstring): the slots side by side, each teacher's
    log-probs shifted by log pi_j (in float32 at least: a half store's are widened first)."""
    total = float(sum(weights))
    dtype = functools.reduce(torch.promote_types, [t.logprobs.dtype for t in teachers], torch.float32)
    return TopKTeacher(torch.cat([teacher.ids for teacher in teachers], dim=-1),
                       torch.cat([teacher.logprobs.to(dtype) + math.log(weight / total)
                                  for teacher, weight in zip(teachers, weights, strict=True)], dim=-1))


class EnsembleRows(RowKind):
    """The rows of several top-K stores over the same samples, their teachers mixed per token with ``weights``
    (module docstring); ``members`` are the stores' kinds (``row_kind`` of each, with the teacher's tokenizer)."""

    teacher_type = TopKTeacher

    def __init__(self, members: Sequence[RowKind], weights: Sequence[float]):
        if len(members) < 2 or len(weights) != len(members):
            raise ValueError(f"an ensemble takes two or more stores, each with a weight; got {len(members)} stores "
                             f"and {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"ensemble weights {list(weights)}: expected each > 0")
        first = members[0]
        for member in members:
            if member.teacher_type is not TopKTeacher:
                raise ValueError(f"{member.reader.path}: an ensemble mixes top-K (or top-p) stores of the teacher's "
                                 f"tokenizer, not {type(member).__name__} (sampled draws estimate one teacher)")
            for name in ("tokenizer", "seq_length", "temperature", "layout"):
                mine, theirs = getattr(member.reader.spec, name), getattr(first.reader.spec, name)
                if mine != theirs:
                    raise ValueError(f"an ensemble's stores must share their {name}: {first.reader.path} has "
                                     f"{theirs!r}, {member.reader.path} {mine!r}")
        super().__init__(first.reader, seq_length=first.seq_length)
        self.members, self.weights = tuple(members), tuple(weights)

    @classmethod
    def serves(cls, spec, student) -> bool:
        """Never looked up for one store: an ensemble is built from several (``EnsembleRows(members, weights)``)."""
        return False

    def validate(self, *, vocab_size: int | None = None, k: int | None = None) -> None:
        for member in self.members:
            member.validate(vocab_size=vocab_size, k=k)

    def check(self, options: KDLossOptions, *, context_parallel_size: int = 1, heal: bool = False) -> list[str]:
        warned = {}
        for member in self.members:
            warned.update(dict.fromkeys(member.check(options, context_parallel_size=context_parallel_size,
                                                     heal=heal)))
        return list(warned)

    def rows_per_sample(self) -> int:
        return self.members[0].rows_per_sample()

    def num_samples(self) -> int:
        """The samples every member holds (a store cached over more of the same data adds none)."""
        return min(member.num_samples() for member in self.members)

    def slots(self) -> int:
        return sum(member.slots() for member in self.members)

    def hint(self, samples) -> None:
        samples = list(samples)
        for member in self.members:
            member.hint(samples)

    def row(self, sample: int, window: int) -> KDRow:
        rows = [member.row(sample, window) for member in self.members]
        for member, row in zip(self.members[1:], rows[1:]):
            if not all(torch.equal(getattr(row, name), getattr(rows[0], name))
                       for name in ("tokens", "labels", "loss_mask", "position_ids")):
                raise ValueError(f"sample {sample}: {member.reader.path} holds other tokens than "
                                 f"{self.members[0].reader.path} (or other loss masks or positions); an ensemble's "
                                 "stores must cache the same samples")
        return rows[0]._replace(teacher=mixture_teacher([row.teacher for row in rows], self.weights))
