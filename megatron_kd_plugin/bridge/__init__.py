"""Megatron-Bridge integration: the dataset provider, the KD forward step, the KD config and the CPU loop. It reads
stores only through ``megatron_kd_plugin.cache``'s names; its models come from ``megatron_kd_plugin.models``.

``forward_step`` itself needs only megatron-core (the GPU check runs it without Bridge; its rows come from the
cache): without Megatron-Bridge installed the package still imports, only without ``register``.

- ``provider.TopKCacheDatasetProvider``: ``cfg.dataset`` over a teacher cache store (its rows' kind:
  ``megatron_kd_plugin.cache.row_kind``).
- ``forward_step.kd_forward_step``: the forward step for ``pretrain(cfg, kd_forward_step)``.
- ``config.KDConfigContainer``: a ConfigContainer whose ``kd`` section is the loss's ``KDLossOptions``.
- ``register.register()``: lets Bridge configs name the plugin's classes as ``_target_``.
- ``cpu_train.train_on_cpu``: the CPU development path (Bridge's loop needs CUDA); ``cpu_checkpoint``: its
  checkpoints in Bridge's layout.
"""

try:
    from megatron_kd_plugin.bridge.register import register
except ModuleNotFoundError as error:   # no Megatron-Bridge: forward_step still imports
    if not (error.name or "").startswith("megatron.bridge"):
        raise

__all__ = ["register"]
