"""The data-mixture demo (``demo --mixture``, issue #30): its two domains of the stdlib, and (opt-in, ~3-8 min on 2
cores: ``KD_DEMO_MIXTURE=1``) the whole mini run through the package's commands.

    KD_DEMO_MIXTURE=1 PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_demo_mixture.py -s
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from megatron_kd_plugin.demo import data, mixture
from tests.distributed import scaled

SOURCE = '''"""Module docstring: English prose."""
import os  # a comment stays with the code


class Thing:
    """A class docstring
    on two lines."""

    def method(self):
        """A method docstring."""
        return os.sep  # code
'''


def test_a_file_splits_into_code_without_docstrings_and_its_docstrings():
    code, prose = mixture.split_domains(SOURCE)
    assert "docstring" not in code and "import os  # a comment stays with the code" in code
    assert "class Thing:" in code and "return os.sep  # code" in code
    assert prose == "Module docstring: English prose.\n\nA class docstring\non two lines.\n\nA method docstring."
    assert mixture.split_domains("def broken(:\n") is None


def test_the_two_domains_hold_out_the_same_files_and_leave_the_test_suites_out():
    cfg = mixture.PRESETS["mini"]
    documents = mixture.domain_documents(cfg)
    for (domain, split), docs in documents.items():
        assert docs and sum(d.size for d in docs) >= cfg.budgets()[domain, split], (domain, split)
        assert all(data.is_heldout(d.name, cfg.heldout_every) == (split == "heldout") for d in docs)
        assert not any(mixture.TEST_FOLDERS & set(pathlib.PurePosixPath(d.name).parts[:-1]) for d in docs)
    assert '"""' not in "".join(d.read() for d in documents["prose", "train"][:3])


def test_blend_override_is_megatrons_syntax_without_the_stores_of_weight_zero():
    stores = {"code": pathlib.Path("/s/code.zarr"), "prose": pathlib.Path("/s/prose.zarr")}
    assert mixture.blend_override((0.5, 0.5), stores) == "dataset.blend=0.5 /s/code.zarr 0.5 /s/prose.zarr"
    assert mixture.blend_override((1.0, 0.0), stores) == "dataset.blend=1 /s/code.zarr"


@pytest.mark.skipif(not os.environ.get("KD_DEMO_MIXTURE"), reason="the mini mixture demo (~3-8 min): "
                                                                    "KD_DEMO_MIXTURE=1")
def test_mini_mixture_demo_end_to_end(tmp_path):
    """Two caches (one teacher run each), three heals on blends from the same pruned student, a table per domain;
    the 0.5:0.5 heal logs each store's KD loss."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "demo", "--mixture", "--preset", "mini",
                           "--output", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=scaled(1800))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    commands = (out / "commands.sh").read_text().splitlines()[1:]
    assert sum(" cache " in c for c in commands) == 2 and sum(" train " in c for c in commands) == 3
    assert "'dataset.blend=0.5 " in commands[3] and "dataset.cache_path" not in commands[3]
    result = json.loads((out / "metrics.json").read_text())
    assert result["forwards"] == {"code": 32, "prose": 32}
    assert set(result["metrics"]) == {"code", "prose"}
    for row in result["histories"]["0.5:0.5"]:
        assert {"kd loss [code]", "kd loss [prose]"} <= row.keys()
    assert "kd loss [prose]" not in result["histories"]["1:0"][0]
    table = (out / "results.md").read_text()
    assert "| healed on code:prose 0.5:0.5 |" in table and "64 (cache: 32 code + 32 prose samples)" in table
