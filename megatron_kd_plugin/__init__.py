"""megatron_kd_plugin: cheap LLM knowledge distillation for Megatron-Core and Megatron-Bridge.

Layers, each importing only from those below it (CONTRIBUTING.md, "Layers"; ``tests/test_layers.py`` checks it):
  * ``cpu_compat``, ``kernels``, ``loss`` — the fused chunked top-K KL loss (plus dense and forward-chunked
    references) and its kernels; ``models`` — megatron-core models from the project's GPT and from Hugging Face
    checkpoints (AutoBridge);
  * ``cache`` — the offline teacher top-K cache (a Zarr v3 store), its writer and reader, and the student rows read
    from it (one module per kind of teacher row); ``bridge`` —
    Megatron-Bridge integration (dataset provider, KD forward step, config, the CPU loop), which reads stores only
    through ``megatron_kd_plugin.cache``;
  * ``recipes`` — the named KD recipes (their sources are the repository's top-level ``recipes/`` folder, installed
    as this subpackage by ``pyproject.toml``'s package-dir);
  * ``commands`` (``cache``, ``inspect``, ``train``, ``plan``) and ``demo`` — ``python -m megatron_kd_plugin``.
"""

__version__ = "0.1.0"
