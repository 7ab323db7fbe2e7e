"""The log-prob grid codec (issue #21) against a float64 reference, and stores written with it (the default) or with
the codec before it."""

import json

import numpy as np
import pytest
import torch
import zarr

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.logprob_grid import PAD_CODE, TAIL_SLACK, LogprobGrid, grid_points
from megatron_kd_plugin.cache.kinds.topk import vocab_parallel_topk

from tests.test_cache_store import K, N, table_teacher, windows, write

GRID = fmt.LOGPROB_CODECS[fmt.DEFAULT_LOGPROB_CODEC].grid


def reference_row(row: np.ndarray, grid: np.ndarray, balance: bool = True) -> np.ndarray:
    """The decoded row of the module docstring's math, slot by slot in float64: the max in float16, each slot's
    grid point by brute force over the divergence d(p, q) = p log(p/q) - p + q, then the mass balance's moves."""
    finite = np.isfinite(row)
    top = np.float32(np.float16(row.max())) if finite.any() else np.float32(-np.inf)
    codes = np.full(len(row), PAD_CODE)
    for k in np.flatnonzero(finite):
        u = float(top) - row[k]                                                  # p = e^-u, q = e^-g relative to e^top
        codes[k] = int(np.argmin(np.exp(-u) * (grid - u) - np.exp(-u) + np.exp(-grid)))

    def value(code):
        return -np.inf if code == PAD_CODE else float(top - np.float32(grid[code]))

    exact = np.exp(row[finite]).sum()
    while balance:
        excess = sum(np.exp(value(c)) for c in codes) - exact
        if abs(excess) <= TAIL_SLACK * max(1 - exact, 0):
            break
        best = (abs(excess), None, None)                                         # (|excess after|, slot, code)
        for k in np.flatnonzero(finite):
            code = codes[k] + (1 if excess > 0 else -1)
            if 0 <= code < len(grid):
                after = abs(excess + np.exp(value(code)) - np.exp(value(codes[k])))
                if after < best[0]:
                    best = (after, k, code)
        if best[1] is None:
            break
        codes[best[1]] = best[2]
    return np.array([value(c) for c in codes])


def rows_with_edges(rng, k: int = 7) -> np.ndarray:
    """Rows of K log-probs: a Dirichlet's (max anywhere), padding after the kept slots and inside, ties, one
    near-certain row (mass ~1, the mass balance's case), values far below the max, all padding, a single slot."""
    rows = np.log(rng.dirichlet(np.full(k + 3, 0.3), size=40))[:, :k]             # mass < 1, max anywhere
    rows[5, 3:] = -np.inf                                                        # top-p padding after the kept
    rows[6, [0, 4]] = -np.inf                                                    # padding anywhere
    rows[7] = -2.0                                                               # ties: every slot the max
    rows[8] = np.log(np.r_[1 - 1e-4 - 6 * 1e-5, np.full(k - 1, 1e-5)])           # near-certain, tiny tail
    rows[9, 1:] = rows[9, 0] - np.array([30.0, 24.5, 23.9, 12.0, 0.001, 1e-6])   # beyond the span, tiny steps
    rows[10] = -np.inf                                                           # a row of padding only
    rows[11] = np.r_[-40.0, -1e-7, np.full(k - 2, -60.0)]                        # extreme values
    return rows


def test_grid_codec_matches_the_float64_reference_exactly():
    rows = rows_with_edges(np.random.default_rng(0))
    codec = LogprobGrid(rows.shape[1], *GRID)
    decoded = codec.decode(codec.encode(rows)).reshape(rows.shape)
    assert decoded.dtype == np.float32
    expected = np.stack([reference_row(row, codec.grid) for row in rows])
    np.testing.assert_array_equal(decoded.astype(np.float64), expected)
    unbalanced = np.stack([reference_row(row, codec.grid, balance=False) for row in rows])
    assert (unbalanced != expected).any()                                        # the balance had work to do
    assert np.array_equal(np.isneginf(decoded), np.isneginf(rows))               # padding comes back, only it
    for row, back in zip(rows, decoded):                # the max slot: m in float16 (where not moved)
        if np.isfinite(row).any() and np.array_equal(back, reference_row(row, codec.grid, balance=False)):
            assert back[np.argmax(row)] == np.float32(np.float16(row.max()))


def test_grid_codec_keeps_each_value_in_its_grid_interval_and_the_tail_its_mass():
    rng = np.random.default_rng(1)
    rows = np.log(rng.dirichlet(np.full(60, 0.2), size=300))[:, :50]
    rows[:20] = np.log(np.maximum(rng.dirichlet(np.full(50, 0.05), size=20), 1e-30))   # mass 1: balanced rows
    codec = LogprobGrid(50, *GRID)
    decoded = codec.decode(codec.encode(rows)).reshape(rows.shape).astype(np.float64)
    grid = grid_points(*GRID)
    top = rows.max(1, keepdims=True).astype(np.float16).astype(np.float32)
    offset = top.astype(np.float64) - rows
    index = np.clip(np.searchsorted(grid, offset), 1, len(grid) - 1)              # offset in [g_index-1, g_index]
    below, above = (top - grid[index - 1].astype(np.float32)), (top - grid[index].astype(np.float32))
    nearest = codec.values[np.searchsorted(codec.boundaries, offset)]
    kept = (np.float32(top) - nearest == decoded).all(1)                         # rows the balance left alone
    inside = offset <= grid[-1]
    assert kept.sum() > 250 and (~kept).any()
    hit = (decoded == below) | (decoded == above)
    assert hit[kept[:, None] & inside].all()                                     # one of the two bracketing points
    exact = np.exp(rows).sum(1)
    miss = np.abs(np.exp(decoded).sum(1) - exact)
    miss_nearest = np.abs(np.exp((np.float32(top) - nearest).astype(np.float64)).sum(1) - exact)
    assert (miss <= miss_nearest + 1e-12).all() and (miss < miss_nearest / 2).sum() >= 20   # it only improves
    assert (miss <= TAIL_SLACK * (1 - exact) + 1e-12)[20:].mean() > 0.9           # to 5 % of the ghost mass
    assert np.abs(decoded - rows)[inside].max() > 1e-3                            # it really quantises


@pytest.mark.parametrize("grid", [GRID, (1 / 64, 0.5, 0.5, 24.0), (1 / 8, 0.0, 1 / 8, 24.0)])
def test_the_encoders_bin_lookup_is_searchsorted_over_the_boundaries(grid):
    codec = LogprobGrid(4, *grid)
    b = codec.boundaries
    offsets = np.concatenate([np.random.default_rng(2).uniform(-0.5, 40, 200_000), b, np.nextafter(b, -1),
                              np.nextafter(b, 99), [0.0, -0.0, grid[3], 1e30]])
    np.testing.assert_array_equal(codec._nearest(offsets), np.searchsorted(b, np.maximum(offsets, 0)))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_grid_codec_refuses_nan_and_plus_inf(bad):
    codec = LogprobGrid(3, *GRID)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        codec.encode(np.array([[-1.0, bad, -2.0]]))


def test_a_store_written_with_the_default_reads_back_exactly_as_quantised(tmp_path):
    table, logits_fn = table_teacher()
    source = windows()
    write(tmp_path / "c", source, logits_fn, temperature=0.8)
    reader = TopKCacheReader(tmp_path / "c")
    assert reader.spec.logprob_codec == fmt.DEFAULT_LOGPROB_CODEC == "grid8"
    codec = LogprobGrid(K, *GRID)
    group = zarr.open_group(tmp_path / "c", mode="r")
    document = json.loads((tmp_path / "c" / fmt.LOGPROBS / "zarr.json").read_text())
    assert document["codecs"][0]["configuration"]["codecs"][0]["name"] == "numcodecs.kd_logprob_grid"
    for i in range(N):
        tokens = torch.from_numpy(source.windows(i, i + 1))[:, :-1]
        top = vocab_parallel_topk(logits_fn(tokens), K, temperature=0.8)          # what the writer computes
        ids, order = top.ids[:, 0].sort(dim=-1)
        logprobs = top.logprobs[:, 0].gather(-1, order).numpy()
        sample = reader[i]
        assert torch.equal(sample.teacher.ids, ids)
        expected = codec.decode(codec.encode(logprobs)).reshape(logprobs.shape)
        np.testing.assert_array_equal(sample.teacher.logprobs.numpy(), expected)
        np.testing.assert_array_equal(group[fmt.LOGPROBS][i], expected)           # zarr's own read: the same


def test_a_store_of_the_codec_before_the_grid_is_still_read(tmp_path):
    """fp16-bitround7 (the default before issue #21) keeps its exact codec chain, so stores written by older
    versions still match what the reader expects, and its values read back within bfloat16's precision."""
    table, logits_fn = table_teacher()
    source = windows()
    write(tmp_path / "c", source, logits_fn, logprob_codec="fp16-bitround7")
    chains = {name: json.loads((tmp_path / "c" / name / "zarr.json").read_text())["codecs"][0]["configuration"]
              ["codecs"] for name in (fmt.IDS, fmt.LOGPROBS)}
    assert [c["name"] for c in chains[fmt.IDS]] == ["numcodecs.delta", "bytes", "blosc", "crc32c"]
    assert chains[fmt.IDS][2]["configuration"]["shuffle"] == "bitshuffle"
    assert [c["name"] for c in chains[fmt.LOGPROBS]] == ["numcodecs.bitround", "bytes", "blosc", "crc32c"]
    assert chains[fmt.LOGPROBS][0]["configuration"]["keepbits"] == 7
    reader = TopKCacheReader(tmp_path / "c")
    for i in range(N):
        window = torch.from_numpy(source.windows(i, i + 1)[0])
        exact = torch.log_softmax(table.double()[window[:-1]], dim=-1).gather(-1, reader[i].teacher.ids)
        error = (reader[i].teacher.logprobs.double() - exact).abs()
        assert (error <= (2.0 ** -8 + 2.0 ** -11) * exact.abs() + 1e-5).all()


def test_a_cross_tokenizer_store_under_the_grid_keeps_its_realised_logprobs_in_fp16_bitround7(tmp_path):
    """One value per token has no row to quantise against: ``teacher_realised_logprob`` stays fp16-bitround7."""
    from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes

    table, logits_fn = table_teacher()
    source = windows()
    vocab = TokenBytes([bytes([65 + i % 26]) * (1 + i // 26) for i in range(table.shape[0])])
    write(tmp_path / "c", source, logits_fn, vocab_table=vocab)
    document = json.loads((tmp_path / "c" / fmt.REALISED_LOGPROB / "zarr.json").read_text())
    assert document["data_type"] == "float16"
    assert [c["name"] for c in document["codecs"][0]["configuration"]["codecs"]][:1] == ["numcodecs.bitround"]
    reader = TopKCacheReader(tmp_path / "c")
    logp = torch.log_softmax(table.double(), -1)
    for i in range(N):
        tokens = reader[i].tokens
        expected = logp[tokens[:-1], tokens[1:]]
        error = (reader[i].realised_logprob.double() - expected).abs()
        assert (error <= (2.0 ** -8 + 2.0 ** -11) * expected.abs() + 1e-5).all()
