"""The README's set-up commands refuse cleanly, touching nothing, when no Python >= 3.12 exists."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.distributed import scaled

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", ["demo", "test"])
def test_run_script_without_python_312_explains_and_changes_nothing(tmp_path, command):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    venv = tmp_path / "venv"
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "no-pyenv"),
           "KD_VENV": str(venv)}
    result = subprocess.run([str(bin_dir / "bash"), str(REPO / "tools" / "run.sh"), command],
                            env=env, capture_output=True, text=True, timeout=scaled(60))
    assert result.returncode == 1
    assert "needs Python >= 3.12" in result.stderr and "pyenv install 3.12" in result.stderr
    assert not venv.exists()
    assert sorted(os.listdir(tmp_path)) == ["bin"]


def test_module_entry_point_lists_commands_and_rejects_unknown():
    from megatron_kd_plugin.__main__ import main

    assert main([]) == 2
    assert main(["no-such-command"]) == 2
