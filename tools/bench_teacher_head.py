"""The fused teacher head against today's whole-logits head, side by side: peak memory, tokens/s, time over the logits
GEMM, at T = 4K, 16K, 64K and TP = 1, 2 (``megatron_kd_plugin.cache.head_benchmark``; flags: ``--help``)."""

from megatron_kd_plugin.cache.head_benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
