"""The offline teacher cache: a Zarr v3 store of each token's top-K teacher ids and log-probs, or (sampled mode) of
N ids drawn from the teacher with their log-probs.

``format.py`` the store schema, ``topk.py`` vocab-parallel top-K extraction, ``sample.py`` vocab-parallel
sampling and the importance weights, ``sources.py`` token windows (Megatron indexed dataset or JSONL + tokenizer),
``teacher_forward.py`` the teacher's forward under TP x PP x EP, ``writer.py`` the resumable (DP x TP) writer,
``lock.py`` its one-run-at-a-time lock, ``reader.py`` random access as torch tensors (``records.py`` its checked
sample reads, ``chunk_reader.py`` the checking chunk reads under them), ``token_bytes.py`` and ``align.py`` the
teacher tokenizer's byte table and the cross-tokenizer chunk alignment (``student_alignments.py`` each
sample's alignment computed once, in memory and in a sidecar beside the store). The commands that drive them (``cache``,
``inspect``) are in ``megatron_kd_plugin.commands``.

The names below are the interface the layers above (``bridge``, the commands) read stores through.
"""

from megatron_kd_plugin.cache.align import CHUNK_IDS, CHUNK_LOGPROBS, PAIR_KEYS, pair_topk
from megatron_kd_plugin.cache.format import SAMPLE_WEIGHTS, CacheSpec
from megatron_kd_plugin.cache.reader import TopKCacheReader
from megatron_kd_plugin.cache.student_alignments import StudentAlignments, load_or_write, sidecar_path
from megatron_kd_plugin.cache.token_bytes import TokenBytes

__all__ = ["CHUNK_IDS", "CHUNK_LOGPROBS", "PAIR_KEYS", "SAMPLE_WEIGHTS", "CacheSpec", "StudentAlignments",
           "TokenBytes", "TopKCacheReader", "load_or_write", "pair_topk", "sidecar_path"]
