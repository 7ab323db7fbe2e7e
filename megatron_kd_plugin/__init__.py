"""megatron_kd_plugin: cheap LLM knowledge distillation for Megatron-Core and Megatron-Bridge.

Layers, each importing only from those below it (CONTRIBUTING.md, "Layers"; ``tests/test_layers.py`` checks it):
  * ``cpu_compat``, ``kernels``, ``loss`` — the fused chunked top-K KL loss (plus dense and forward-chunked
    references) and its kernels; ``models`` — megatron-core models from the project's GPT and from Hugging Face
    checkpoints (AutoBridge);
  * ``cache`` — the offline teacher top-K cache (a Zarr v3 store), its writer and reader; ``bridge`` —
    Megatron-Bridge integration (dataset provider, KD forward step, config, the CPU loop), which reads stores only
    through ``megatron_kd_plugin.cache``;
  * ``recipes`` — the named KD recipes;
  * ``commands`` (``cache``, ``inspect``, ``train``, ``plan``) and ``demo`` — ``python -m megatron_kd_plugin``.
"""

from megatron_kd_plugin import _moved

__version__ = "0.1.0"

_moved.install()
