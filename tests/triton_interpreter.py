"""Run a test module again in a fresh process with ``TRITON_INTERPRET=1``, where Triton kernels run on CPU.

The interpreter must be on before triton is first imported, and megatron-core imports triton at import time, so
in the pytest process that collected this module it is too late; a fresh process is the only place to switch it on.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter_active() -> bool:
    """True when this process may run Triton kernels (CUDA, or the interpreter switched on at start)."""
    import torch

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def run_module_interpreted(test_module: str) -> str:
    """Run ``pytest test_module`` under TRITON_INTERPRET=1; fail with its output unless every test passed."""
    from tests.distributed import scaled

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5",
                          test_module], cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]
    return run.stdout
