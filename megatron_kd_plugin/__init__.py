"""megatron_kd_plugin: cheap LLM knowledge distillation for Megatron-Core and Megatron-Bridge.

Three parts, each importable on its own:
  * ``megatron_kd_plugin.cache``  — the offline teacher top-K cache (a Zarr v3 store), its writer and reader;
  * ``megatron_kd_plugin.loss``   — the fused chunked top-K KL loss (plus dense and forward-chunked references);
  * ``megatron_kd_plugin.bridge`` — Megatron-Bridge integration (the only part that imports ``megatron.bridge``).
"""

__version__ = "0.1.0"
