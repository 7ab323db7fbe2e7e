"""One call that makes the plugin's classes usable from Megatron-Bridge configs (YAML files, ``_target_`` overrides).

Bridge instantiates a ``_target_`` only under allow-listed module prefixes (``megatron.``, ``torch.``, ...). A
config naming ``megatron_kd_plugin.bridge.provider.TopKCacheDatasetProvider`` (or the ``KDConfigContainer`` /
``KDLossOptions`` that ``cfg.to_yaml()`` writes for a KD recipe) fails with Bridge's ``InstantiationException``
("not in the allowlist") until ``register()`` adds this package's prefix. The recipes are plain functions in the
``megatron_kd_plugin.recipes`` package (``RECIPES``) and need no registration.
"""

from __future__ import annotations

from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix, target_allowlist

PLUGIN_PREFIX = "megatron_kd_plugin"


def is_registered() -> bool:
    """True once Bridge accepts ``_target_`` paths under ``megatron_kd_plugin.``."""
    return target_allowlist.is_allowed(f"{PLUGIN_PREFIX}.bridge.provider.TopKCacheDatasetProvider")


def register() -> None:
    """Allow Bridge to instantiate the plugin's ``_target_`` classes (idempotent)."""
    if not is_registered():
        register_allowed_target_prefix(PLUGIN_PREFIX)
