"""tools/gpu_check.sh as the lent GPU machine runs it (issues 19 and 32).

The lent machine's ``python3`` is itself a venv (/opt/torch/.venv/bin/python3, Python 3.12.3: torch 2.11.0+cu130,
triton 3.6.0, numpy 2.5.2, transformers, pip) without network. The stand-in here (:func:`lent_python`): a venv made
from the base interpreter of this project's venv, without system site-packages, whose own site-packages hold links
to exactly torch, triton, numpy, transformers, pip and their dependencies from this venv; no PYTHONPATH. The wheels
are this venv's installed distributions of tools/gpu_wheels.txt repacked (:func:`repacked_wheels`: the pinned
versions, no index, no download); the script installs them with ``pip --no-index``.

In the suite: the wheel list against the stages' imports and the constraints; no wheels refused at once in one
line; and the preflight on the stand-in (``--preflight``: interpreter, wheels, offline install, every version and
import), once with the stand-in first on PATH and once behind a ``python3.12`` that lacks torch. Before issue 32 the
script failed both: it made a venv from the lent venv (which sees the base interpreter's site-packages: no torch)
and tried ``python3.12`` before ``python3``.

Opt-in (~2.5 min): the whole check on CPU, every stage at tiny shapes, one stage cut by a simulated budget:

    KD_GPU_REHEARSAL=1 PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_gpu_check.py -k rehearsal -s
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from tests.distributed import scaled
from tools.gpu_preflight import STAGE_IMPORTS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"
WHEEL_LIST = REPO / "tools" / "gpu_wheels.txt"
ON_THE_MACHINE = ("torch", "triton", "numpy", "transformers", "pip")
RELIED_ON = ("torch", "triton", "numpy")
"""What the wheel set takes from the machine (with their dependencies); transformers' dependencies are not relied on."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(name: str):
    """Run-time requirements of an installed distribution (no extras)."""
    for line in importlib.metadata.requires(name) or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            yield requirement


def _closure(names) -> set[str]:
    """The distributions ``names`` need at run time (no extras), themselves included, from this venv's metadata."""
    seen, todo = set(), list(names)
    while todo:
        name = _canonical(todo.pop())
        if name not in seen:
            seen.add(name)
            todo += [requirement.name for requirement in _requirements(name)]
    return seen


def _wheel_list() -> dict[str, tuple[str, set[str]]]:
    """tools/gpu_wheels.txt -> {name: (version, stages)}."""
    wheels = {}
    for line in WHEEL_LIST.read_text().splitlines():
        spec, _, comment = line.partition("#")
        if spec.strip():
            name, version = spec.strip().split("==")
            wheels[_canonical(name)] = (version, set(comment.split("stages:")[1].split()))
    return wheels


def test_wheel_list_matches_the_stages_imports_and_the_constraints():
    """Each stage's tagged wheels are exactly its third-party imports' run-time closure minus torch, triton, numpy and
    their dependencies, plus those of their dependencies a carried package asks a version of (typing-extensions for
    zarr); every pin is tools/constraints.txt's and this venv's; torch, triton and numpy are never wheels."""
    wheels = _wheel_list()
    preinstalled = _closure(RELIED_ON)
    provided_by = importlib.metadata.packages_distributions()
    assert set(STAGE_IMPORTS) == {"correctness", "loss", "step", "student", "head", "tests"}
    for stage, modules in STAGE_IMPORTS.items():
        distributions = {_canonical(provided_by[module.split(".")[0]][0]) for module in modules
                         if not module.startswith("megatron_kd_plugin")}
        closure = _closure(distributions)
        asked = {_canonical(requirement.name) for name in closure - preinstalled for requirement in
                 _requirements(name) if requirement.specifier and _canonical(requirement.name) not in RELIED_ON}
        needed = closure - preinstalled | (asked & preinstalled)
        tagged = {name for name, (_, tags) in wheels.items() if stage in tags}
        assert tagged == needed, (stage, sorted(tagged - needed), sorted(needed - tagged))
    assert "typing-extensions" in wheels and not set(wheels) & set(RELIED_ON)
    constraints = dict(line.split("==") for line in (REPO / "tools" / "constraints.txt").read_text().splitlines()
                       if "==" in line and not line.startswith("#"))
    for name, (version, _) in wheels.items():
        pinned = {_canonical(key): value for key, value in constraints.items()}.get(name)
        assert pinned in (None, version), (name, version, pinned)
        assert importlib.metadata.version(name) == version, name     # the versions this venv's tests ran with


def _clean_env(tmp_path: Path, **extra) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(OUT=str(tmp_path / "out"), TMPDIR=str(tmp_path), PIP_NO_INDEX="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def test_refuses_at_once_naming_the_missing_wheels(tmp_path):
    """No wheels: exit 3 after the interpreter, before any install, in one line naming every wheel of the list, the
    download command and what to carry; $OUT holds the summary alone."""
    env = _clean_env(tmp_path, KD_GPU_WHEELS=str(tmp_path / "wheels"), KD_PYTHON=sys.executable)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 3, done.stdout + done.stderr
    error = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(error) == 1, done.stdout
    for name, (version, _) in _wheel_list().items():
        assert f"{name}=={version}" in error[0].replace("_", "-").lower(), (name, error)
    assert "bash tools/gpu_check.sh --download" in error[0] and "carry tools/wheels" in error[0]
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["summary.md"]
    assert not list(tmp_path.glob("kd_gpu_site.*"))


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def lent_python(root: Path) -> Path:
    """A venv like the lent machine's python3 (module docstring); returns its bin folder."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(root)], check=True, timeout=scaled(60))
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    source = Path(importlib.metadata.distribution("torch").locate_file(""))
    names, todo = set(), list(ON_THE_MACHINE)
    while todo:   # dependencies with extras, as pip installed them
        name = _canonical(todo.pop())
        if name not in names:
            names.add(name)
            todo += [Requirement(line).name for line in importlib.metadata.requires(name) or []
                     if _installed(Requirement(line).name)]
    for name in names:
        for file in importlib.metadata.distribution(name).files or []:
            top = file.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and not (site / top).exists() and (
                    source / top).exists():
                (site / top).symlink_to(source / top)
    return root / "bin"


def repacked_wheels(target: Path) -> Path:
    """Every wheel of tools/gpu_wheels.txt, rebuilt from this venv's installed files (its RECORD, its WHEEL tag)."""
    target.mkdir()
    for name, (version, _) in _wheel_list().items():
        dist = importlib.metadata.distribution(name)
        assert dist.version == version, name
        tag = next(line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines()
                   if line.startswith("Tag:"))
        root = Path(dist.locate_file(""))
        with zipfile.ZipFile(target / f"{name.replace('-', '_')}-{version}-{tag}.whl", "w") as wheel:
            for file in dist.files or []:
                if file.parts[0] != ".." and "__pycache__" not in file.parts and (root / file).is_file():
                    wheel.write(root / file, str(file))
    return target


@pytest.fixture(scope="module")
def lent_machine(tmp_path_factory):
    """(bin folder of the stand-in python3, the repacked wheels, a folder whose python3 and python3.12 lack torch)."""
    root = tmp_path_factory.mktemp("lent")
    decoy = root / "decoy"
    decoy.mkdir()
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    for name in ("python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        (decoy / name).symlink_to(base)
    return lent_python(root / "venv"), repacked_wheels(root / "wheels"), decoy


def test_preflight_on_a_python_that_is_a_venv(lent_machine, tmp_path):
    """The preflight as on the lent machine (~30 s): python3 and python3.12 ahead on PATH lack torch and are passed
    over for the stand-in venv's python, the wheels install offline beside it (no venv is made), torch, triton and
    numpy come from it, every carried version and every stage's import checks out, the device is named. Before issue
    32 the script took python3.12 and stopped; given the venv's interpreter (KD_PYTHON) it made a venv from it that
    had no torch (docs/how-it-works/kernels.md)."""
    venv_bin, wheels, decoy = lent_machine
    env = _clean_env(tmp_path, PATH=os.pathsep.join([str(decoy), str(venv_bin), "/usr/bin", "/bin"]),
                     KD_GPU_WHEELS=str(wheels))
    done = subprocess.run(["bash", str(SCRIPT), "--preflight"], env=env, capture_output=True, text=True,
                          timeout=scaled(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"preflight: {venv_bin / 'python'} (cp3" in summary, summary
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert f"passed over (no torch): {decoy / 'python3'} {decoy / version}" in summary, summary
    assert "from the machine torch " in summary
    assert f"carried: {len(_wheel_list())} distributions at their pins" in summary
    assert "imports ok" in summary and "device: cpu (no CUDA)" in summary
    assert "Warning" not in summary, summary                     # the summary is for a person: no import noise
    assert not list(tmp_path.rglob("pyvenv.cfg")), "no venv is made"
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["summary.md"]


@pytest.mark.skipif(not os.environ.get("KD_GPU_REHEARSAL"), reason="the CPU rehearsal (~2.5 min): KD_GPU_REHEARSAL=1")
def test_rehearsal_on_a_bare_machine(lent_machine, tmp_path):
    """The whole check as the lent machine runs it, on CPU: every stage starts, prints its figures and ends ok, except
    the last one, cut by a simulated budget of 1 s, which is named CUT while the run still ends with its summary;
    $OUT holds at most 7 files, no folders; the carried size is printed."""
    venv_bin, wheels, _ = lent_machine
    env = _clean_env(tmp_path, PATH=os.pathsep.join([str(venv_bin), "/usr/bin", "/bin"]), KD_GPU_WHEELS=str(wheels))
    done = subprocess.run(["bash", str(SCRIPT), "--budget", "tests=1"], env=env, capture_output=True, text=True,
                          timeout=scaled(900))
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("== ", "preflight"))))
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    out = tmp_path / "out"
    files = sorted(path.name for path in out.iterdir())
    assert len(files) <= 7 and all((out / name).is_file() for name in files), files
    assert files == sorted(["summary.md", "correctness.log", "loss.log", "step.log", "student.log", "head.log",
                            "tests.log"])
    summary = (out / "summary.md").read_text()
    assert "no CUDA" in summary
    for stage in ("correctness", "loss", "step", "student", "head"):
        assert f"== stage {stage} ok" in summary, (stage, summary)
    assert "== stage tests CUT at its 1 s budget" in summary and "not ok: tests (cut at 1 s)" in summary
    assert "result: correctness ok" in summary and "| fused_triton/grad_in_forward |" in summary
    assert "| step | fused_grad_in_forward |" in summary and "result: kd loss" in summary
    assert "result: fused teacher head ids equal torch.topk's" in summary
    carried = re.search(r"the checkout with its wheels is (\d+) MiB", summary)
    assert carried and int(carried.group(1)) < 64, summary[:2000]


def test_every_stage_takes_a_budget():
    """``--budget STAGE=N`` is accepted for every stage (``head`` was refused); the parse is checked by an ``--only``
    that fails after it, so nothing runs."""
    for stage in ("correctness", "loss", "step", "student", "head", "tests"):
        done = subprocess.run(["bash", str(SCRIPT), "--budget", f"{stage}=5", "--only", "nosuch"],
                              capture_output=True, text=True, timeout=scaled(30))
        assert done.returncode == 2 and "error: --only takes" in done.stdout, (stage, done.stdout)
    done = subprocess.run(["bash", str(SCRIPT), "--budget", "nosuch=5"], capture_output=True, text=True,
                          timeout=scaled(30))
    assert done.returncode == 2 and "error: --budget takes" in done.stdout
