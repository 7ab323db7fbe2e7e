"""Modules that moved in 0.2 (#22, one direction of imports), importable under their old names for one release.

``import megatron_kd_plugin.bridge.hf`` (or ``python -m megatron_kd_plugin.cache.cli``) still works: it warns
(``DeprecationWarning``) once per name and gives the module at its new place — the same module object, so state and
``mock.patch`` targets are shared. The package's ``__init__`` installs :class:`MovedModuleFinder` at import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import pathlib
import sys
import warnings

MOVED = {
    "megatron_kd_plugin.gpt": "megatron_kd_plugin.models.gpt",
    "megatron_kd_plugin.bridge.hf": "megatron_kd_plugin.models.hf",
    "megatron_kd_plugin.bridge.student": "megatron_kd_plugin.models.student",
    "megatron_kd_plugin.bridge.train_cli": "megatron_kd_plugin.commands.train",
    "megatron_kd_plugin.bridge.memory_plan": "megatron_kd_plugin.commands.plan",
    "megatron_kd_plugin.cache.cli": "megatron_kd_plugin.commands.cache",
    "megatron_kd_plugin.cache.inspect": "megatron_kd_plugin.commands.inspect",
}
_PACKAGE_DIR = str(pathlib.Path(__file__).parent)


def _warn(old: str) -> None:
    warnings.warn(f"{old} moved to {MOVED[old]}; the old name goes away in the next release", DeprecationWarning,
                  stacklevel=2, skip_file_prefixes=(_PACKAGE_DIR, "<frozen importlib"))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str):
        self.old = old

    def exec_module(self, module) -> None:
        _warn(self.old)
        sys.modules[self.old] = importlib.import_module(MOVED[self.old])   # the import system returns this entry

    def get_code(self, fullname: str):
        """``python -m OLD``: runpy runs the new module's code."""
        _warn(self.old)
        return importlib.util.find_spec(MOVED[self.old]).loader.get_code(MOVED[self.old])


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname)) if fullname in MOVED else None


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
