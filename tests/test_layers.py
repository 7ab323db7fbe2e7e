"""The package's layers hold for every import (CONTRIBUTING.md, "Layers"): each unit imports only from units in
lower layers, never from its own layer or above, and ``bridge`` reads stores only through the names
``megatron_kd_plugin.cache`` exports. Every import statement counts, the lazy ones inside functions too. Also: no two
modules share a file name (one meaning per name)."""

from __future__ import annotations

import ast
import importlib
import collections
import os
import pathlib

PACKAGE = "megatron_kd_plugin"
REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / PACKAGE
FOLDERS = {PACKAGE: ROOT, f"{PACKAGE}.recipes": REPO / "recipes"}
"""Where each part of the package's sources lives (pyproject.toml's package-dir: the recipes are the top-level
folder)."""

# Lowest first. A unit is a subpackage or a top-level module of the package.
LAYERS = (
    {"cpu_compat", "kernels"},
    {"loss", "models", "documents"},
    {"cache", "bridge"},
    {"recipes"},
    {"commands"},
    {"demo", "__main__"},
    {"command_reference"},   # docs: reads every command's parser
)
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}
STORE_INTERFACE = "megatron_kd_plugin.cache"   # the one thing of cache's that bridge may import from


def package_sources() -> dict[str, str]:
    """{module name: source} of every module of the package, the recipes included."""
    sources = {}
    for prefix, top in FOLDERS.items():
        for folder, _, files in os.walk(top):
            for name in files:
                if name.endswith(".py"):
                    parts = (pathlib.Path(folder) / name).relative_to(top).with_suffix("").parts
                    module = ".".join((prefix,) + (parts[:-1] if parts[-1] == "__init__" else parts))
                    sources[module] = (pathlib.Path(folder) / name).read_text()
    return sources


def imports_of(module: str, source: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, the names taken from it, line) for every package-internal import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == PACKAGE:
                found.append((target, [alias.name for alias in node.names], node.lineno))
    return found


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None        # None: the package itself


def violations(sources: dict[str, str], packages: set[str], cache_exports: set[str]) -> list[str]:
    """One line per import against the layers."""
    found = []
    for module, source in sorted(sources.items()):
        unit = unit_of(module)
        for target, names, line in imports_of(module, source, module in packages):
            if target == PACKAGE and names:                 # from megatron_kd_plugin import x: the module x
                targets = [(f"{PACKAGE}.{name}", []) for name in names]
            else:
                targets = [(target, names)]
            for imported, taken in targets:
                other = unit_of(imported)
                where = f"{module}:{line} imports {imported}"
                if other is None or other == unit:
                    continue
                if unit is None:                              # the package's own __init__
                    found.append(f"{where}: the package's __init__ imports nothing of its own")
                    continue
                if other not in RANK or unit not in RANK:
                    found.append(f"{where}: unit {other if other not in RANK else unit!r} has no layer")
                elif unit == "bridge" and other == "cache":
                    if imported != STORE_INTERFACE or not set(taken) <= cache_exports:
                        found.append(f"{where} {taken}: bridge reads stores only through the names "
                                     f"{STORE_INTERFACE} exports")
                elif RANK[other] >= RANK[unit]:
                    found.append(f"{where}: {other!r} is not in a layer below {unit!r}")
    return found


def test_every_import_goes_down_the_layers():
    sources = package_sources()
    assert {"megatron_kd_plugin.recipes.tiny", "megatron_kd_plugin.commands.cache", "megatron_kd_plugin.models.hf",
            "megatron_kd_plugin.bridge.provider", "megatron_kd_plugin.cache.rows.slot_rows"} <= set(sources)
    packages = {m for m in sources if m in FOLDERS or (ROOT.joinpath(*m.split(".")[1:]) / "__init__.py").is_file()}
    cache = importlib.import_module(STORE_INTERFACE)
    assert violations(sources, packages, set(cache.__all__)) == []
    # the commands are reached by name only, from the top
    from megatron_kd_plugin.__main__ import COMMANDS
    assert {unit_of(target) for target in COMMANDS.values()} == {"commands", "demo"}


def test_the_check_finds_imports_against_the_layers():
    planted = {
        "megatron_kd_plugin.cache.writer": "from megatron_kd_plugin.bridge import dataset\n",
        "megatron_kd_plugin.bridge.dataset": "from megatron_kd_plugin.cache.store.format import TOKENS\n"
                                             "from megatron_kd_plugin.cache import TOKENS, format\n",
        "megatron_kd_plugin.loss.fused": "def f():\n    import megatron_kd_plugin.models.hf\n",
        "megatron_kd_plugin.models.student": "from ..commands import train\n",
        "megatron_kd_plugin.recipes": "from .tiny import x\nfrom megatron_kd_plugin import demo\n",
        "megatron_kd_plugin.bridge.provider": "from megatron_kd_plugin.cache import TopKCacheReader\n"
                                              "from ..models import hf\n",
    }
    found = violations(planted, {"megatron_kd_plugin.recipes"}, {"TOKENS", "TopKCacheReader"})
    assert [line.split(" imports ")[0] for line in found] == [
        "megatron_kd_plugin.bridge.dataset:1", "megatron_kd_plugin.bridge.dataset:2",
        "megatron_kd_plugin.cache.writer:1", "megatron_kd_plugin.loss.fused:2",
        "megatron_kd_plugin.models.student:1", "megatron_kd_plugin.recipes:2"], found


def test_no_two_modules_share_a_file_name():
    """One meaning per name: a module's file name (``__init__`` and ``__main__`` aside) occurs once in the package."""
    names = collections.Counter(module.rsplit(".", 1)[-1] for module in package_sources()
                                if module not in FOLDERS and not module.endswith(".__main__"))
    packages = {module.rsplit(".", 1)[-1] for module in package_sources()
                if (ROOT.joinpath(*module.split(".")[1:]) / "__init__.py").is_file()}
    assert [name for name, count in names.items() if count > 1 and name not in packages] == []


def import_circles(sources: dict[str, str], packages: set[str]) -> list[list[str]]:
    """Every import circle among the package's modules (the strongly connected components of more than one module,
    or of one that imports itself): every import statement counts, the lazy ones inside functions too, but not the
    annotations-only ones under ``if TYPE_CHECKING:``."""
    graph = {}
    for module, source in sources.items():
        tree = ast.parse(source)
        for node in ast.walk(tree):                   # drop TYPE_CHECKING blocks before collecting
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = [ast.Pass()]
        edges = set()
        for target, names, _ in imports_of(module, ast.unparse(tree), module in packages):
            submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in sources]
            # ``from package import submodule`` needs only the submodule: the package's __init__ runs first anyway
            for imported in submodules + ([target] if len(submodules) < len(names) or not names else []):
                if imported in sources and imported != module:
                    edges.add(imported)
        graph[module] = edges
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):                                  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _packages(sources: dict[str, str]) -> set[str]:
    return {m for m in sources if m in FOLDERS or (ROOT.joinpath(*m.split(".")[1:]) / "__init__.py").is_file()}


def test_no_import_circles():
    """No module of the package imports, directly or through others, a module that imports it (issue #40)."""
    sources = package_sources()
    assert import_circles(sources, _packages(sources)) == []


def test_the_circle_check_finds_a_circle():
    planted = {"megatron_kd_plugin.loss.a": "from . import b\n",
               "megatron_kd_plugin.loss.b": "def f():\n    from megatron_kd_plugin.loss.c import x\n",
               "megatron_kd_plugin.loss.c": "from .a import y\n",
               "megatron_kd_plugin.loss.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from .e import z\n",
               "megatron_kd_plugin.loss.e": "from .d import w\n"}
    assert import_circles(planted, set()) == [["megatron_kd_plugin.loss.a", "megatron_kd_plugin.loss.b",
                                               "megatron_kd_plugin.loss.c"]]
