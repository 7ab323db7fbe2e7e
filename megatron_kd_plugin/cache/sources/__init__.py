"""Token sources the cache writer reads: fixed windows of tokens from Megatron indexed datasets, JSONL or arrays, on
disk or object storage."""
