"""The package as pip installs it, without the repository: from a working directory outside the checkout, with
only the installed copy on PYTHONPATH, its command runs and every module imports (nothing reaches for the
repository's ``tools/`` or root). ``tests/test_demo.py`` runs the miniature demo from such an installation."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

from megatron_kd_plugin.demo.scratch import PRESETS
from tests.distributed import scaled

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def install_package(target: pathlib.Path) -> pathlib.Path:
    """Installs the checkout's package non-editable into ``target`` (offline, from a copy of the files the build
    reads, so the checkout gains no build/ or egg-info); returns ``target``."""
    source = target.parent / f"{target.name}-source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, source / name)
    for folder in ("megatron_kd_plugin", "recipes"):   # recipes/: installed as megatron_kd_plugin.recipes
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, capture_output=True,
                   timeout=scaled(120))
    return target


def outside_repo_env(installed: pathlib.Path) -> dict[str, str]:
    """The environment of a process that sees the installed copy and the venv, not the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, PYTHONPATH=str(installed))


IMPORT_EVERYTHING = textwrap.dedent("""
    import contextlib, importlib, io, json, pathlib, pkgutil, sys
    import megatron_kd_plugin
    modules = [megatron_kd_plugin]
    for info in pkgutil.walk_packages(megatron_kd_plugin.__path__, "megatron_kd_plugin."):
        modules.append(importlib.import_module(info.name))
    from megatron_kd_plugin.commands.train import build_config, main as train
    with contextlib.redirect_stdout(io.StringIO()) as listed:
        assert train(["--list"]) == 0
    from megatron_kd_plugin.demo import scratch as pipeline
    cfg = pipeline.PRESETS["mini"]
    config = build_config(pipeline.STUDENT_RECIPE, pipeline.student_overrides(
        cfg, pathlib.Path("cache.zarr"), 512, pathlib.Path("run"), alpha=cfg.kd_alpha))
    print(json.dumps({"files": [m.__file__ for m in modules], "names": [m.__name__ for m in modules], "sys_path": [str(pathlib.Path(p).resolve()) for p in sys.path],
                      "num_layers": config.model.num_layers, "alpha": config.kd.alpha,
                      "listed": listed.getvalue().splitlines(),
                      "cache_path": str(config.dataset.cache_path)}))
""")


def test_installed_package_runs_without_the_repository(installed_package, tmp_path):
    installed = installed_package
    # nothing outside the package's own name: the recipes install as megatron_kd_plugin.recipes (package-dir)
    assert sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info")) == ["megatron_kd_plugin"]
    recipes = installed / "megatron_kd_plugin" / "recipes"
    assert recipes.is_dir() and not recipes.is_symlink() and (recipes / "tiny.py").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = outside_repo_env(installed)

    usage = subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "--help"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=scaled(60))
    assert usage.returncode == 0, usage.stderr
    assert all(command in usage.stdout for command in ("demo", "cache", "train", "inspect"))
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    from megatron_kd_plugin.recipes import RECIPES
    assert set(RECIPES) <= set(report["listed"]), report["listed"]      # what `train --list` printed there
    assert len(report["files"]) > 20 and "megatron_kd_plugin.recipes.tiny" in report["names"]
    assert all(pathlib.Path(f).is_relative_to(installed) for f in report["files"]), report["files"]
    venv = pathlib.Path(sys.prefix).resolve()   # the environment may live inside the checkout (.venv/)
    assert not any(pathlib.Path(p).is_relative_to(REPO_ROOT) and not pathlib.Path(p).is_relative_to(venv)
                   for p in report["sys_path"]), report["sys_path"]
    mini = PRESETS["mini"]   # the recipe resolved, with the from-scratch demo's overrides applied
    assert (report["num_layers"], report["alpha"], report["cache_path"]) == (
        mini.student.num_layers, mini.kd_alpha, "cache.zarr")


def test_pyproject_lists_every_subpackage():
    """pyproject.toml names the packages one by one (the recipes come from another folder): every folder of the
    package with an __init__.py is listed, and nothing else."""
    import tomllib

    listed = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {".".join(p.parent.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "megatron_kd_plugin").rglob(
        "__init__.py") if "__pycache__" not in p.parts}
    assert sorted(listed) == sorted(folders | {"megatron_kd_plugin.recipes"})


def test_the_package_outside_bridge_imports_without_megatron_bridge():
    """CONTRIBUTING's rule: with ``megatron.bridge`` unimportable (the lent GPU machine has no Transformer Engine,
    hence no Bridge), the loss, the kernels, the store, inspect and the cache command still import."""
    import subprocess
    import sys

    modules = ["megatron_kd_plugin", "megatron_kd_plugin.loss", "megatron_kd_plugin.kernels",
               "megatron_kd_plugin.cache", "megatron_kd_plugin.cache.writer", "megatron_kd_plugin.cache.rows.row_kinds",
               "megatron_kd_plugin.commands.cache", "megatron_kd_plugin.commands.inspect",
               "megatron_kd_plugin.models.gpt", "megatron_kd_plugin.cpu_compat"]
    code = ("import sys; sys.modules['megatron.bridge'] = None\n"
            + "".join(f"import {name}\n" for name in modules)
            + "assert sys.modules['megatron.bridge'] is None")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
