"""The offline teacher cache: a Zarr v3 store of each token's top-K teacher ids and log-probs, or (sampled mode) of
N ids drawn from the teacher with their log-probs.

Five rooms, each a subpackage with one job, and the writer that joins them:

- ``store/``: the store itself, local or on object storage: its schema (``format.py``, ``array_names.py``), checked
  chunk reads (``chunk_reader.py``) and sample reads (``records.py``), the writers' lock (``lock.py``) or lease on
  object storage (``lease.py``), where it lives (``storage.py``), the reader (``reader.py``) and its read-ahead,
  moving a store (``store_copy.py``); the log-prob codec is ``logprob_grid.py`` beside them (its entry points name
  that path);
- ``kinds/``: what a store holds per token, one module per kind (top-K, top-p, sampled, head + draws) with the
  vocab-parallel math that computes it (``topk.py``, ``draws.py``, ``head_draws.py``), and the registry the writer,
  reader, ``inspect`` and the cache command dispatch through;
- ``sources/``: the token windows the writer reads (Megatron indexed datasets on disk or object storage, JSONL);
- ``rows/``: a student's training rows: the typed row and the dataset (``kd_rows.py``), one module per kind of row
  (``slot_rows.py``: any store read with the teacher's tokenizer; ``cross_tokenizer_rows.py``), the lookup
  (``row_kinds.py``), several stores (``blended_rows.py``, ``ensemble_rows.py``) and the epoch order
  (``window_order.py``);
- ``cross_tokenizer/``: what a student with its own tokenizer needs: the byte table (``token_bytes.py``), the
  alignment of the two tokenizations (``align.py``), first tokens and token-level slots, each sample's alignment
  computed once (``student_alignments.py``).

``writer.py`` is the resumable (DP x TP x CP) writer, ``teacher_forward.py`` the teacher's forward under TP x PP x EP x
CP, ``teacher_head.py`` the fused head that turns its hidden states into a kind's rows block by block (no [T, V/tp]
logits), ``teacher_context_parallel.py`` the teacher's CP slicing and the rows' reassembly. The
commands that drive them (``cache``, ``inspect``, ``copy``) are in ``megatron_kd_plugin.commands``.

The names below are the interface the layers above (``bridge``, the commands) read stores through. They are imported
when first named, so that importing a part of the store (``store/``: reading, copying and verifying a store) never
imports torch, which the reader and the rows need.
"""

import importlib

_WHERE = {
    "BlendedRows": "rows.blended_rows", "check_blend": "rows.blended_rows", "EnsembleRows": "rows.ensemble_rows",
    "CacheSpec": "store.format", "CachedSample": "store.reader", "TopKCacheReader": "store.reader",
    "row_kind": "rows.row_kinds", "KDRow": "rows.kd_rows", "KDRows": "rows.kd_rows", "RowKind": "rows.kd_rows",
    "RankRows": "rows.rank_rows", "TokenBytes": "cross_tokenizer.token_bytes",
}
"""{exported name: the module of this package that defines it}."""

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
