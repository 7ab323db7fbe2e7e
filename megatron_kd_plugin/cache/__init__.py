"""The offline teacher cache: a Zarr v3 store of each token's top-K teacher ids and log-probs, or (sampled mode) of
N ids drawn from the teacher with their log-probs.

``format.py`` the store schema, ``kinds/`` the kinds of store (top-K, top-p, sampled, head + draws: one module
each, and the registry the writer, reader, ``inspect`` and the cache command dispatch through), ``topk.py``
vocab-parallel top-K extraction, ``draws.py`` vocab-parallel draws and their importance weights, ``sources.py``
token windows (Megatron indexed dataset or JSONL + tokenizer), ``teacher_forward.py`` the teacher's forward under
TP x PP x EP, ``writer.py`` the resumable (DP x TP) writer, ``lock.py`` its one-run-at-a-time lock, ``reader.py``
random access as torch tensors (``records.py`` its checked sample reads, ``chunk_reader.py`` the checking chunk reads
under them). Student rows: ``rows.py`` (the typed row, the protocol of a kind of row and the dataset over them), one
module per kind of row (``slot_rows.py``: a store read with the teacher's tokenizer, its teacher the store kind's;
``cross_tokenizer_rows.py``, with ``token_bytes.py``, ``align.py`` and ``student_alignments.py``: the teacher
tokenizer's byte table, the alignment of the two tokenizations, each sample's alignment computed once), and
``row_kinds.py``, which looks the kind up for a store and a student. Several stores: ``blended_rows.py`` (a weighted
blend of stores, megatron-core's blending order) and ``ensemble_rows.py`` (teachers over the same samples, mixed per
token). The commands that drive them (``cache``, ``inspect``) are in ``megatron_kd_plugin.commands``.

The names below are the interface the layers above (``bridge``, the commands) read stores through.
"""

from megatron_kd_plugin.cache.blended_rows import BlendedRows, check_blend
from megatron_kd_plugin.cache.ensemble_rows import EnsembleRows
from megatron_kd_plugin.cache.format import CacheSpec
from megatron_kd_plugin.cache.reader import CachedSample, TopKCacheReader
from megatron_kd_plugin.cache.row_kinds import row_kind
from megatron_kd_plugin.cache.rows import KDRow, KDRows, RowKind
from megatron_kd_plugin.cache.token_bytes import TokenBytes

__all__ = ["BlendedRows", "CacheSpec", "CachedSample", "EnsembleRows", "KDRow", "KDRows", "RowKind", "TokenBytes", "TopKCacheReader",
           "check_blend", "row_kind"]
