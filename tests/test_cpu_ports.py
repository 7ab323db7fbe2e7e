"""Runs side by side on one machine (issue #30): a CPU run started without torchrun takes no TCP port, so a second
run never dies of the first one's (the loop once set MASTER_PORT=29533 itself: EADDRINUSE); a port the user chose
that is taken is one line naming MASTER_PORT."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.distributed import scaled

SCRIPT = r"""
import json, os, socket, sys
import torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds
from megatron_kd_plugin.bridge import cpu_train

apply_cpu_workarounds()
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
occupied = [held]
try:                                   # the port the loop used to take for itself, held as a first run holds it
    first_run = socket.socket()
    first_run.bind(("127.0.0.1", 29533))
    first_run.listen()
    occupied.append(first_run)
except OSError:
    pass                               # taken already: by a real run
result = {}
os.environ["MASTER_PORT"] = str(held.getsockname()[1])
try:
    cpu_train.init_cpu_distributed(1)
    result["chosen"] = "started"
except Exception as error:
    result["chosen"] = f"{type(error).__name__}: {error}"
del os.environ["MASTER_PORT"]
try:
    cpu_train.init_cpu_distributed(1)
    value = torch.ones(1)
    dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
    result["unset"] = f"started, world {dist.get_world_size()}, sum {float(value)}"
except Exception as error:
    result["unset"] = f"{type(error).__name__}: {error}"
print(json.dumps(result))
"""


def test_a_run_without_torchrun_needs_no_port_and_a_taken_master_port_is_named():
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["unset"] == "started, world 1, sum 1.0", result
    chosen = result["chosen"]
    assert chosen.startswith("MasterPortInUse: MASTER_PORT=") and "\n" not in chosen, chosen
    assert "is already in use" in chosen and "set MASTER_PORT to a free port" in chosen, chosen

