"""tools/gpu_check.sh as the lent GPU machine runs it (issue 19, items 5-9).

In the suite (cheap): the wheel list and the script's per-stage imports agree (each stage's wheels are exactly what
its imports need beyond the machine's torch, triton, numpy and transformers, pinned as tools/constraints.txt), and
the script refuses at once, naming the wheels it lacks.

Not in the suite (~2 min): the CPU rehearsal, run with

    bash tools/gpu_check.sh --download      # once, with the package index reachable
    KD_GPU_REHEARSAL=1 PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_gpu_check.py -k rehearsal -s

It makes the GPU machine's Python: the interpreter the shared venv was made from (its site-packages hold only pip)
with, on PYTHONPATH, links to exactly the distributions of torch, triton, numpy and transformers and their
dependencies taken from this venv (the cheapest honest stand-in: the same files, nothing else visible, no copy and
no download). The script then runs with no package index (PIP_NO_INDEX=1, and it installs with --no-index): a fresh
--system-site-packages venv gets the wheel set offline, every stage starts and, without CUDA, runs its CPU smoke
after saying "no CUDA"; the carried size is printed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from tests.distributed import scaled

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"
WHEEL_LIST = REPO / "tools" / "gpu_wheels.txt"
ON_THE_MACHINE = ("torch", "triton", "numpy", "transformers")
RELIED_ON = ("torch", "triton", "numpy")
"""What the wheel set takes from the machine (with their dependencies); transformers' dependencies are not relied on."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names) -> set[str]:
    """The distributions ``names`` need at run time (no extras), themselves included, from this venv's metadata."""
    seen, todo = set(), list(names)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _wheel_list() -> dict[str, tuple[str, set[str]]]:
    """tools/gpu_wheels.txt -> {name: (version, stages)}."""
    wheels = {}
    for line in WHEEL_LIST.read_text().splitlines():
        spec, _, comment = line.partition("#")
        if spec.strip():
            name, version = spec.strip().split("==")
            stages = comment.split("stages:")[1].split()
            wheels[_canonical(name)] = (version, set(stages))
    return wheels


def _stage_imports() -> dict[str, list[str]]:
    """The script's ``stage_imports`` table: {stage: [module, ...]}."""
    text = SCRIPT.read_text()
    table = text[text.index("declare -A stage_imports=("):]
    table = table[:table.index(")\n")]
    return {stage: modules.split() for stage, modules in re.findall(r'\[(\w+)\]="([^"]*)"', table)}


def test_wheel_list_matches_the_stages_imports_and_the_constraints():
    """Each stage's tagged wheels are exactly its imports' run-time closure minus torch, triton, numpy and their
    dependencies; every pin is the one tools/constraints.txt gives; torch, triton and numpy are never wheels."""
    wheels = _wheel_list()
    preinstalled = _closure(RELIED_ON)
    provided_by = importlib.metadata.packages_distributions()
    stages = _stage_imports()
    assert set(stages) == {"kernels", "student", "step", "loss"}
    for stage, modules in stages.items():
        distributions = {_canonical(provided_by[module.split(".")[0]][0]) for module in modules}
        needed = _closure(distributions) - preinstalled
        tagged = {name for name, (_, tags) in wheels.items() if stage in tags}
        assert tagged == needed, (stage, sorted(tagged - needed), sorted(needed - tagged))
    assert not set(wheels) & set(RELIED_ON)
    constraints = dict(line.split("==") for line in (REPO / "tools" / "constraints.txt").read_text().splitlines()
                       if "==" in line and not line.startswith("#"))
    for name, (version, _) in wheels.items():
        pinned = {_canonical(key): value for key, value in constraints.items()}.get(name)
        assert pinned in (None, version), (name, version, pinned)
        assert importlib.metadata.version(name) == version, name     # the versions this venv's tests ran with


def test_refuses_at_once_naming_the_missing_wheels(tmp_path):
    """No wheels: exit 3 before any venv or stage, naming every wheel of the list and the download command."""
    env = dict(os.environ, KD_GPU_WHEELS=str(tmp_path / "wheels"), OUT=str(tmp_path / "out"),
               KD_GPU_VENV=str(tmp_path / "venv"), KD_PYTHON=sys.executable)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "torch, triton and numpy come from the machine" in done.stdout
    for name, (version, _) in _wheel_list().items():
        assert f"{name}=={version}" in done.stdout.replace("_", "-").lower(), (name, done.stdout)
    assert "bash tools/gpu_check.sh --download" in done.stdout
    assert not (tmp_path / "venv").exists() and (tmp_path / "out" / "log.txt").exists()


def _machine_site(target: Path) -> None:
    """Links to the files of ON_THE_MACHINE's distributions and their dependencies (extras included, as pip
    installed them) from this venv's site-packages, nothing else."""
    site = Path(importlib.metadata.distribution("torch").locate_file(""))
    names, todo = set(), list(ON_THE_MACHINE)
    while todo:
        name = _canonical(todo.pop())
        if name in names:
            continue
        names.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.name and _installed(requirement.name):
                todo.append(requirement.name)
    for name in names:
        for file in importlib.metadata.distribution(name).files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (target / top).exists():
                continue
            if (site / top).exists():
                (target / top).symlink_to(site / top)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not os.environ.get("KD_GPU_REHEARSAL"), reason="the CPU rehearsal (~2 min): KD_GPU_REHEARSAL=1")
def test_rehearsal_on_a_bare_machine(tmp_path):
    """The script as the GPU machine runs it, on CPU: offline install, every stage starts and ends ok."""
    if not list((REPO / "tools" / "wheels").glob("*.whl")):
        pytest.skip("no tools/wheels: run 'bash tools/gpu_check.sh --download' first")
    machine = tmp_path / "machine-site"
    machine.mkdir()
    _machine_site(machine)
    base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(machine), KD_PYTHON=str(base_python), KD_GPU_VENV=str(tmp_path / "venv"),
               OUT=str(tmp_path / "out"), PIP_NO_INDEX="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=scaled(600))
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("== ")))   # stages, sizes, times
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "no CUDA" in summary
    for stage in ("kernels", "student", "step", "loss"):
        assert f"== stage {stage} ok" in summary, (stage, summary)
    assert "kd loss: first two" in summary and '"variant": "fused_recompute"' in summary
    assert "| fused_triton |" in summary
    carried = re.search(r"checkout carried (\d+) KiB", done.stdout)
    assert carried and int(carried.group(1)) < 64 * 1024, done.stdout[:2000]
