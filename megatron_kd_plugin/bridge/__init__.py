"""Megatron-Bridge integration — the only part of the plugin that imports ``megatron.bridge``.

- ``provider.TopKCacheDatasetProvider``: ``cfg.dataset`` over a teacher top-K cache store.
- ``forward_step.kd_forward_step``: the forward step for ``pretrain(cfg, kd_forward_step)``.
- ``config.KDConfigContainer`` / ``KDConfig``: a ConfigContainer with the ``kd`` loss section.
- ``register.register()``: lets Bridge configs name the plugin's classes as ``_target_``.
- ``cpu_train.train_on_cpu``: the CPU development path (Bridge's loop needs CUDA).
"""

from megatron_kd_plugin.bridge.register import register

__all__ = ["register"]
