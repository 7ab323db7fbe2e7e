"""The quality benchmark's byte accounting: a truncated top-K store is sized like a store written at that K, and
the equal-bytes K is the largest one within the budget."""

from __future__ import annotations

import pytest

from tests.test_cache_store import K, windows, write
from tools.bench_quality import equal_bytes_k, store_bytes_per_token, truncated_topk_bytes


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """(top-K store, {k: bytes/token of the store the cache tool writes at top-k}, {k: bytes/token of the top-K
    store truncated to k}); fp32 log-probs, so truncation has no rounding ties to break."""
    folder = tmp_path_factory.mktemp("stores")
    written = {}
    for k in range(1, K + 1):
        write(folder / f"top{k}.zarr", source=windows(n=32, seq=32), k=k, logprob_codec="fp32")
        written[k] = store_bytes_per_token(folder / f"top{k}.zarr")
    full = folder / f"top{K}.zarr"
    truncated = {k: truncated_topk_bytes(full, k, folder / "scratch.zarr") for k in range(1, K + 1)}
    assert not (folder / "scratch.zarr").exists()
    return full, written, truncated


def test_truncated_store_takes_the_bytes_of_a_store_written_at_k(sizes):
    _, written, truncated = sizes
    for k in written:
        assert truncated[k] == pytest.approx(written[k], rel=2e-3), k   # the same chunks; attributes may differ
    assert list(written.values()) == sorted(written.values())          # bytes grow with K: bisection is valid


def test_equal_bytes_k_is_the_largest_k_within_the_budget(sizes, tmp_path):
    full, _, truncated = sizes
    for budget, expected in ((truncated[1] - 1.0, 1), ((truncated[3] + truncated[4]) / 2, 3),
                             (truncated[K] + 1.0, K)):
        assert equal_bytes_k(full, budget, tmp_path / "s.zarr") == (expected, truncated[expected]), budget


def test_sampled_and_equal_bytes_variants_end_to_end(tmp_path):
    """The benchmark at the mini size from an empty folder: a sampled store by the cache tool (torchrun, TP=2),
    students through the Bridge CPU loop, one table; the sampled student ends closer to the teacher than CE."""
    import json
    import os
    import subprocess
    import sys

    from tools.bench_quality import REPO_ROOT

    work = tmp_path / "q"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_quality.py"), "--preset", "mini", "--output",
                    str(work), "--variants", "ce", "sample8", "eqbytes8"], check=True, cwd=REPO_ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    rows = {name: json.loads((work / "bench" / f"{name}.json").read_text()) for name in ("ce", "sample8", "eqbytes8")}
    sizes = json.loads((work / "bench" / "bytes.json").read_text())
    assert 0 < sizes["eqbytes8"]["bytes_per_token"] <= sizes["sample8"]["bytes_per_token"]
    assert rows["eqbytes8"]["variant"] == f"eqbytes8 (top{sizes['eqbytes8']['k']}-ghost)"
    assert rows["sample8"]["kl_to_teacher"] < rows["ce"]["kl_to_teacher"]
    table = (work / "results.md").read_text()
    assert all(f"| {row['variant']} |" in table for row in rows.values()) and (work / "quality.png").is_file()
