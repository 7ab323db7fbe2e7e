"""Top-K stores (``cache --topk K``, the default): per token the teacher's K most probable ids, sorted ascending by
id, and their full-vocab log-probs (``format.py``; ``topk.vocab_parallel_topk``). Rows are a ``loss.TopKTeacher``;
every loss tail but ``sampled`` serves them."""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.store.array_names import IDS, LOGPROBS, LOGSUMEXP
from megatron_kd_plugin.cache.kinds.store_kind import StoreKind


def topk_statistics(logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(top-K mass ``[...]``, K+1-bucket entropy ``[...]``) of log-probs ``[..., K]`` (-inf: a padding slot)."""
    logprobs = logprobs.astype(np.float64)
    p = np.exp(logprobs)
    mass = p.sum(-1)
    tail = np.clip(1.0 - mass, 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail_term = np.where(tail > 0, tail * np.log(tail), 0.0)
        return mass, -np.where(p > 0, p * logprobs, 0.0).sum(-1) - tail_term


class TopKStore(StoreKind):
    """The teacher's top-K per token (module docstring)."""

    name = "top-K"
    mode = "topk"
    slot = "rank"
    default_codec = "grid8"
    grid_codec = True
    exact_slots = True
    work_bytes_per_logit = 4            # the float32 (tempered) copy; torch.topk's and the LSE's buffers are per token

    def holds(self, spec) -> bool:
        return spec.mode == self.mode

    def check(self, spec) -> None:
        if spec.k > spec.vocab_size:
            raise ValueError(f"k={spec.k} exceeds vocab_size={spec.vocab_size}")

    @property
    def teacher_type(self):
        from megatron_kd_plugin.loss import TopKTeacher

        return TopKTeacher

    def kept(self, spec, logprobs):
        """bool ``[..., K]``: which ranked slots (log-prob descending, a tensor ``[..., K]``) a row keeps, the rest
        padding; None: all."""
        return None

    def teacher_rows(self, logits, spec, *, block, tp_group):
        from megatron_kd_plugin.cache.kinds.topk import id_ordered, vocab_parallel_topk

        top = vocab_parallel_topk(logits, spec.k, temperature=spec.temperature, tp_group=tp_group)
        ids, logprobs = id_ordered(top.ids, top.logprobs, self.kept(spec, top.logprobs))
        return {IDS: ids, LOGPROBS: logprobs, LOGSUMEXP: top.logsumexp}, top.finite

    def describe(self, spec) -> str:
        return f"top-K, K={spec.k}"

    def statistics(self, ids, logprobs):
        mass, entropy = topk_statistics(logprobs)
        return {"top-K mass": mass.ravel(), "entropy (nats, K+1 buckets)": entropy.ravel()}
