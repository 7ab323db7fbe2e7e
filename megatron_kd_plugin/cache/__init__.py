"""The offline teacher cache: a Zarr v3 store of each token's top-K teacher ids and log-probs, or (sampled mode) of
N ids drawn from the teacher with their log-probs.

``format.py`` the store schema, ``topk.py`` vocab-parallel top-K extraction, ``sample.py`` vocab-parallel
sampling and the importance weights, ``sources.py`` token windows
(Megatron indexed dataset or JSONL + tokenizer), ``writer.py`` the resumable (DP x TP) writer, ``lock.py`` its
one-run-at-a-time lock, ``reader.py`` random access as torch tensors (``records.py`` its checked sample reads,
``chunk_reader.py`` the checking chunk reads under them), ``inspect.py`` the ``python -m megatron_kd_plugin inspect`` command.
"""

from megatron_kd_plugin.cache.format import CacheSpec
from megatron_kd_plugin.cache.reader import TopKCacheReader

__all__ = ["CacheSpec", "TopKCacheReader"]
