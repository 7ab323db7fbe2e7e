"""tools/gpu_check.sh's preflight, run with the stages' interpreter and PYTHONPATH (the carried wheels' folder
first): in seconds, every version and import the stages need, or one line per problem and exit 3.

    python tools/gpu_preflight.py --site FOLDER --wheel-list tools/gpu_wheels.txt

Checks: Python >= 3.12; torch, triton and numpy imported from the machine (not from FOLDER) at least at
``MACHINE_FLOORS``; every distribution of the wheel list at its pin and found in FOLDER (not shadowed); every
requirement of every carried distribution met here (zarr's typing-extensions >= 4.14, megatron-core's torch >= 2.6,
numcodecs' numpy >= 2, ...); every module of ``STAGE_IMPORTS`` imports. Last line: ``device: cuda NAME, N GiB`` or
``device: cpu (no CUDA)``, which gpu_check.sh reads.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
import time

MACHINE_FLOORS = {"torch": "2.6", "triton": "3.2", "numpy": "1.26"}
"""The lent machine's own packages (never carried) and the oldest the stages run with (pyproject.toml's floors)."""
STAGE_IMPORTS = {
    "correctness": ["torch", "triton", "numpy", "megatron_kd_plugin.loss", "megatron_kd_plugin.kernels"],
    "loss": ["torch", "triton", "numpy", "megatron_kd_plugin.loss", "megatron_kd_plugin.kernels"],
    "step": ["torch", "triton", "numpy", "megatron.core", "megatron.training.distillation.cached_logits_loss",
             "megatron_kd_plugin.loss", "megatron_kd_plugin.models.gpt", "megatron_kd_plugin.cpu_compat",
             "megatron_kd_plugin.commands.plan"],
    "student": ["torch", "triton", "numpy", "megatron.core", "zarr", "numcodecs", "tqdm", "megatron_kd_plugin.cache",
                "megatron_kd_plugin.bridge.forward_step", "megatron_kd_plugin.cpu_compat"],
    "head": ["torch", "triton", "numpy", "zarr", "numcodecs", "tqdm", "megatron_kd_plugin.cache.writer",
             "megatron_kd_plugin.cache.teacher_head"],
    "tests": ["torch", "triton", "numpy", "pytest", "megatron.core", "megatron_kd_plugin.kernels"],
}
"""Modules each stage of gpu_check.sh imports (tests/test_gpu_check.py holds tools/gpu_wheels.txt to exactly the
third-party closure of these, beyond the machine's)."""


def wheel_pins(path: str) -> dict[str, str]:
    """tools/gpu_wheels.txt -> {canonical name: version}."""
    from packaging.utils import canonicalize_name

    pins = {}
    with open(path) as lines:
        for line in lines:
            spec = line.split("#")[0].strip()
            if spec:
                name, version = spec.split("==")
                pins[canonicalize_name(name)] = version
    return pins


def _inside(path: str, folder: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


def check_machine(site: str) -> list[str]:
    """Python, and torch / triton / numpy from the machine at their floors."""
    from packaging.version import Version

    problems = [] if sys.version_info >= (3, 12) else [f"Python {sys.version.split()[0]} < 3.12"]
    for name, floor in MACHINE_FLOORS.items():
        try:
            module = importlib.import_module(name)
        except Exception as error:   # noqa: BLE001 - any import failure is the finding
            problems.append(f"{name} does not import ({type(error).__name__}: {error})")
            continue
        version = importlib.metadata.version(name)
        if _inside(module.__file__, site):
            problems.append(f"{name} {version} comes from the carried wheels ({module.__file__}), not the machine")
        if Version(version) < Version(floor):
            problems.append(f"{name} {version} < {floor}")
    return problems


def check_carried(site: str, pins: dict[str, str]) -> tuple[list[str], list[str]]:
    """(problems, notes): each pinned distribution at its version from ``site``; every requirement of theirs met."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    problems, met = [], []
    for name, version in pins.items():
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name}=={version} is not installed")
            continue
        if dist.version != version or os.path.realpath(dist.locate_file("")) != os.path.realpath(site):
            problems.append(f"{name} resolves to {dist.version} at {dist.locate_file('')}, not {version} in {site}")
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{name} needs {requirement}: absent")
                continue
            if requirement.specifier and not requirement.specifier.contains(Version(found), prereleases=True):
                problems.append(f"{name} needs {requirement}: found {found}")
            elif requirement.specifier and canonicalize_name(requirement.name) not in pins:
                met.append(f"{requirement} ({found}, the machine's)")
    return problems, met


def check_imports() -> list[str]:
    problems = []
    for module in sorted({m for modules in STAGE_IMPORTS.values() for m in modules}):
        try:
            importlib.import_module(module)
        except Exception as error:   # noqa: BLE001 - any import failure is the finding
            stages = [stage for stage, modules in STAGE_IMPORTS.items() if module in modules]
            problems.append(f"{module} does not import ({type(error).__name__}: {error}); stages {', '.join(stages)}")
    return problems


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return "device: cpu (no CUDA)"
    props = torch.cuda.get_device_properties(0)
    return (f"device: cuda {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
            f"CUDA {torch.version.cuda}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", required=True, help="the folder the wheels were installed into (--target)")
    parser.add_argument("--wheel-list", required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    problems = check_machine(args.site)
    if problems:   # nothing else can be judged without torch
        print("\n".join(f"error: {p}" for p in problems))
        return 3
    pins = wheel_pins(args.wheel_list)
    carried, met = check_carried(args.site, pins)
    problems = carried + check_imports()
    if problems:
        print("\n".join(f"error: {p}" for p in problems))
        return 3
    import numpy
    import torch
    import triton

    print(f"preflight: Python {sys.version.split()[0]}; from the machine torch {torch.__version__}, triton "
          f"{triton.__version__}, numpy {numpy.__version__}; carried: {len(pins)} distributions at their pins; "
          f"requirements met: {'; '.join(met) or 'all carried'}; the stages' {sum(map(len, STAGE_IMPORTS.values()))}"
          f" imports ok ({time.perf_counter() - started:.1f} s)")
    print(device_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
