"""Top-p stores (``cache --top-p P --min-k M``, K the cap): the kept sets against a float64 computation of the
smallest set reaching P (one process, and the vocab-parallel writer at TP=2 on gloo), the padding layout, resume /
DP split / repair byte-identical, the attributes, version and identity, refusals, the reader, dataset, loss and
inspect on the rows; the TP=2 loss on ragged rows in the same spawn."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch
import zarr

from megatron_kd_plugin.cache import CacheSpec, TopKCacheReader
from megatron_kd_plugin.cache.store import format as fmt
from tests.distributed import run_on_ranks
from tests.test_cache_store import K, N, S, V, _delete, _flip, _tree, table_teacher, windows, write
from tests.test_loss_helpers import make_ragged_case, rel_err, run_loss
from tests.test_loss_ragged import reference

P, MIN_K = 0.9, 2


def smallest_sets(logits: torch.Tensor, top_p: float, min_k: int, k: int):
    """float64 reference from full logits [..., V]: (stored ids [..., k], stored log-probs [..., k], kept count
    [...], margin [...]) where the kept set is the smallest prefix of the ids ranked by (log-prob desc, id asc)
    whose mass reaches ``top_p``, clamped to [min_k, k], laid out as a store row (padding id 0 / -inf first, the
    kept ids ascending); margin = the distance of the prefix masses around the cut from top_p (small: the float32
    writer may cut elsewhere)."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    ranked = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    mass = ranked.values.exp().cumsum(-1)                                   # [..., V]
    reached = (mass >= top_p).double().argmax(-1) + 1                       # first prefix reaching top_p
    reached = torch.where((mass >= top_p).any(-1), reached, torch.full_like(reached, logits.shape[-1]))
    kept = reached.clamp(min_k, k)
    slots = torch.arange(k)
    keep = slots < kept[..., None]
    ids = torch.where(keep, ranked.indices[..., :k], -1).sort(dim=-1).values
    stored = torch.where(ids >= 0, logprobs.gather(-1, ids.clamp(min=0)), -torch.inf)
    margin = torch.minimum((mass.gather(-1, (reached - 1)[..., None]).squeeze(-1) - top_p).abs(),
                           (torch.where(reached > 1, mass.gather(-1, (reached - 2).clamp(min=0)[..., None]).squeeze(-1),
                                        torch.zeros_like(kept, dtype=torch.float64)) - top_p).abs())
    return ids.clamp(min=0), stored, kept, margin


def test_top_p_store_keeps_the_smallest_set_reaching_p(tmp_path):
    table, logits_fn = table_teacher()
    source = windows()
    write(tmp_path / "c", source, logits_fn, top_p=P, min_k=MIN_K, logprob_codec="fp32")
    reader = TopKCacheReader(tmp_path / "c")
    counts = []
    for i in range(N):
        tokens = torch.from_numpy(source.windows(i, i + 1)[0])
        ids, logprobs, kept, margin = smallest_sets(table[tokens[:-1]], P, MIN_K, K)
        row = reader[i]
        clear = margin > 1e-5                                               # float32 cannot cut elsewhere
        assert clear.float().mean() > 0.9
        assert torch.equal(row.teacher.ids[clear], ids[clear])
        assert torch.equal((row.teacher.logprobs > -torch.inf).sum(-1)[clear], kept[clear])
        torch.testing.assert_close(row.teacher.logprobs[clear].double(), logprobs[clear], atol=2e-6, rtol=0)
        counts.append(kept)
    counts = torch.cat(counts)
    assert counts.min() == MIN_K and counts.max() == K and ((counts > MIN_K) & (counts < K)).any()


def test_top_p_stores_resume_split_and_repair_byte_identically(tmp_path):
    options = dict(top_p=P, min_k=MIN_K)
    write(tmp_path / "full", **options)
    write(tmp_path / "again", **options)
    write(tmp_path / "other_batches", **options, micro_batch_size=1)
    with pytest.raises(ValueError, match="cannot finish"):
        write(tmp_path / "dp2", **options, dp_rank=0, dp_size=2)
    write(tmp_path / "dp2", **options, dp_rank=1, dp_size=2)
    write(tmp_path / "part", **options)
    group = zarr.open_group(tmp_path / "part", mode="r+")
    (tmp_path / "part" / fmt.RECORDS / "c.1.0").unlink()        # as if killed before the records of shard 1
    group[fmt.IDS][4:8] = 0
    group.attrs.update(complete=False)
    assert write(tmp_path / "part", **options).shards_written == 1
    write(tmp_path / "damaged", **options)
    _flip(tmp_path / "damaged")
    _delete(tmp_path / "damaged")
    assert write(tmp_path / "damaged", **options, repair=True).shards_written == 2
    trees = [_tree(tmp_path / name) for name in ("full", "again", "other_batches", "dp2", "part", "damaged")]
    assert all(tree == trees[0] for tree in trees[1:])


def _old_identity(attrs: dict) -> str:
    """A version-3 store's identity as version 3 readers compute it: SHA-256 of format, version and the fields
    version 3 had (every field but the top-p, the head + draws and the documents layout ones)."""
    fields = {f.name for f in dataclasses.fields(CacheSpec)} - set(fmt.KIND_FIELDS) - {"layout"}
    described = {key: attrs[key] for key in fields} | dict(format=attrs["format"], version=attrs["version"])
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def test_top_p_attributes_version_and_identity(tmp_path, monkeypatch):
    write(tmp_path / "topk")
    attrs = dict(zarr.open_group(tmp_path / "topk").attrs)
    assert attrs["version"] == fmt.FORMAT_VERSION and "top_p" not in attrs and "min_k" not in attrs
    assert attrs["identity"] == _old_identity(attrs)              # top-K stores: the top-p fields not hashed
    write(tmp_path / "c", top_p=P, min_k=MIN_K)
    group = zarr.open_group(tmp_path / "c", mode="r+")
    attrs = dict(group.attrs)
    assert (attrs["version"], attrs["top_p"], attrs["min_k"], attrs["k"]) == (fmt.FORMAT_VERSION, P, MIN_K, K)
    assert attrs["identity"] == fmt.store_identity(CacheSpec.from_attrs(attrs)) != _old_identity(attrs)
    with monkeypatch.context() as patch:                          # an older reader: refused by the version
        patch.setattr(fmt, "READ_VERSIONS", (2, 3, 4))
        with pytest.raises(ValueError, match=rf"cache format version {fmt.FORMAT_VERSION} is not supported \(this "
                                             r"reader reads versions \(2, 3, 4\)\)"):
            TopKCacheReader(tmp_path / "c")
    with pytest.raises(ValueError, match="top_p: requested 0.8, on disk 0.9"):
        write(tmp_path / "c", top_p=0.8, min_k=MIN_K)
    with pytest.raises(ValueError, match="min_k: requested 1, on disk 2"):
        write(tmp_path / "c", top_p=P)
    with pytest.raises(ValueError, match="top_p: requested None, on disk 0.9"):
        write(tmp_path / "c")
    group.attrs["top_p"] = 0.95                                   # an edit the identity catches
    with pytest.raises(ValueError, match="do not match their checksum"):
        TopKCacheReader(tmp_path / "c")
    edited = {key: value for key, value in attrs.items() if key not in ("top_p", "min_k")}
    group.attrs.put(edited | dict(identity=_old_identity(edited)))
    with pytest.raises(ValueError, match="was not written there for this store"):
        TopKCacheReader(tmp_path / "c")[0]                        # relabelled as top-K: its records refuse it
    group.attrs.put(attrs | dict(version=3))
    with pytest.raises(ValueError, match="format version 3 with top_p=0.9"):
        TopKCacheReader(tmp_path / "c")


@pytest.mark.parametrize("fields,message", [
    (dict(top_p=0.0, min_k=1), r"top_p=0.0: expected 0 < top_p <= 1"),
    (dict(top_p=1.5, min_k=1), r"top_p=1.5: expected 0 < top_p <= 1"),
    (dict(top_p=float("nan"), min_k=1), r"top_p=nan"),
    (dict(top_p=0.9, min_k=0), r"min_k=0: expected 1 <= min_k <= k=6"),
    (dict(top_p=0.9, min_k=7), r"min_k=7: expected 1 <= min_k <= k=6"),
    (dict(min_k=2), r"min_k=2 applies to a top-p store only"),
    (dict(top_p=0.9, min_k=1, mode="sampled"), r"top_p=0.9 applies to a top-p store only, not to a sampled store"),
])
def test_cache_spec_refuses_bad_top_p(fields, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec(k=K, vocab_size=V, seq_length=S, num_samples=N, **fields)


@pytest.mark.parametrize("argv,message", [
    (["--top-p", "0"], "error: --top-p=0.0: expected 0 < P <= 1"),
    (["--top-p", "1.01"], "error: --top-p=1.01: expected 0 < P <= 1"),
    (["--top-p", "0.9", "--min-k", "0"], "error: --min-k=0: expected 1 <= M <= --topk=8 (the cap)"),
    (["--top-p", "0.9", "--min-k", "9"], "error: --min-k=9: expected 1 <= M <= --topk=8 (the cap)"),
    (["--min-k", "2"], "error: --min-k=2 only applies to a top-p store: add --top-p P"),
])
def test_cli_refuses_bad_top_p_in_one_line_writing_nothing(tmp_path, capsys, argv, message):
    from megatron_kd_plugin.commands.cache import main

    assert main(["--teacher", str(tmp_path / "t"), "--data", "d", "--output", str(tmp_path / "o"),
                 "--seq-length", "8", "--topk", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [message] and not (tmp_path / "o").exists()


def test_cli_refuses_top_p_with_sample(tmp_path, capsys):
    from megatron_kd_plugin.commands.cache import main

    assert main(["--teacher", "t", "--data", "d", "--output", str(tmp_path / "o"), "--seq-length", "8",
                 "--draws", "8", "--top-p", "0.9"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --top-p and --draws exclude each other: a top-p store keeps the most probable ids up to the mass P "
        "(--topk K is its cap), a sampled store draws N ids from the whole distribution"]


def test_top_p_rows_through_reader_dataset_loss_and_inspect(tmp_path, capsys):
    from megatron_kd_plugin.cache import KDRows, row_kind
    from megatron_kd_plugin.commands.inspect import main as inspect_main

    write(tmp_path / "c", top_p=P, min_k=MIN_K)
    reader = TopKCacheReader(tmp_path / "c")
    dataset = KDRows(row_kind(reader, seq_length=S // 2), np.arange(N), num_rows=4, seed=0)
    rows = [dataset[j] for j in range(4)]
    gen = torch.Generator().manual_seed(0)
    case = dict(hidden=torch.randn(S // 2, 4, 5, generator=gen, dtype=torch.float64),
                weight=torch.randn(V, 5, generator=gen, dtype=torch.float64),
                teacher_ids=torch.stack([r.teacher.ids for r in rows], 1),               # [s, b, K]
                teacher_logprobs=torch.stack([r.teacher.logprobs for r in rows], 1).double(),
                loss_mask=torch.stack([r.loss_mask for r in rows], 1).double(),
                labels=torch.stack([r.labels for r in rows], 1))
    assert (case["teacher_logprobs"] == -torch.inf).any()
    for tail, divergence in (("ghost", "forward_kl"), ("renorm", "jsd")):
        ref, ref_dh, ref_dw, _ = reference(case, tail=tail, divergence=divergence, temperature=1.3)
        got, dh, dw = run_loss(case, tail=tail, divergence=divergence, temperature=1.3)   # validate=True
        assert max(rel_err(got.loss_sum, ref), rel_err(dh, ref_dh), rel_err(dw, ref_dw)) < 1e-9
    assert inspect_main([str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    kept = np.concatenate([np.isfinite(reader[i].teacher.logprobs.numpy()).sum(-1) for i in range(N)])
    mass = np.concatenate([np.exp(reader[i].teacher.logprobs.double().numpy()).sum(-1) for i in range(N)])
    assert f"mode: top-p, P={P}, min-k={MIN_K}, at most K={K} ids per token" in out
    line = next(line for line in out.splitlines() if "kept ids per token" in line).split()
    assert [int(v) for v in line[4:11]] == [int(v) for v in np.quantile(kept, (0, .05, .25, .5, .75, .95, 1),
                                                                       method="lower")]
    assert line[-1] == f"{kept.mean():.4f}"
    line = next(line for line in out.splitlines() if "mass kept" in line).split()
    assert line[-1] == f"{mass.mean():.4f}" and "nan" not in out


PADDED = 38                                                      # the ragged loss case's vocab, 2 shards of 19


def _tp2_writer_and_loss(k: int, top_p: float, min_k: int):
    """On each of 2 ranks: the vocab-parallel writer's top-p rows of logits [s, b, V] sharded over TP=2, and the
    TP=1 rows; the ragged-row loss at TP=2 (each tail, fused both modes and forward-chunked) against the float64
    definitions."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.cache.writer import teacher_rows

    group, rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(11)
    scale = torch.linspace(0.5, 8.0, 7)[:, None, None]                          # flat to peaked teachers
    logits = (torch.randn(7, 3, 40, generator=gen) * scale).float()             # [s, b, V]
    spec = CacheSpec(k=k, vocab_size=40, seq_length=7, num_samples=3, top_p=top_p, min_k=min_k)
    sharded, _ = teacher_rows(logits[..., rank * 20:(rank + 1) * 20], spec, first_sample=0, tp_group=group)
    single, _ = teacher_rows(logits, spec, first_sample=0, tp_group=None)
    case = make_ragged_case(s=3, b=5, hidden_size=9, vocab=PADDED, k=6, seed=4)
    shard = slice(rank * PADDED // 2, (rank + 1) * PADDED // 2)
    errors = {}                         # each tail at TP=2 (every tail x divergence: tests/test_loss_ragged.py)
    for tail, divergence in (("ghost", "forward_kl"), ("ghost", "jsd"), ("none", "forward_kl"),
                             ("renorm", "reverse_kl")):
        options = dict(tail=tail, divergence=divergence, temperature=1.4, alpha=0.6, with_labels=True)
        ref, ref_dh, ref_dw, _ = reference(case, **options)
        for impl, mode in (("fused", "recompute"), ("fused", "grad_in_forward"), ("forward_chunked", "recompute")):
            got, dh, dw = run_loss(case, weight=case["weight"][shard], tp_group=group, impl=impl, mode=mode,
                                   chunk_bytes=4 * 19 * 8 * 2, **options)
            errors[tail, divergence, impl, mode] = max(rel_err(got.loss_sum, ref), rel_err(dh, ref_dh),
                                                       rel_err(dw, ref_dw[shard]))
    return dict(logits=logits, sharded=sharded, single=single, errors=errors)


def test_tp2_writer_keeps_the_float64_smallest_sets_and_ragged_loss_matches():
    results = run_on_ranks(2, _tp2_writer_and_loss, 12, 0.95, 3, tp=2)
    for result in results:
        sharded, single = result["sharded"], result["single"]
        ids, logprobs, kept, margin = smallest_sets(result["logits"], 0.95, 3, 12)
        clear = margin > 1e-5                   # the TP=2 log-sum-exp rounds differently from TP=1's (~1e-7)
        assert clear.float().mean() > 0.9 and kept.min() == 3 and kept.max() == 12
        assert torch.equal(sharded[fmt.IDS][clear], single[fmt.IDS][clear])     # TP=2 keeps what TP=1 keeps
        torch.testing.assert_close(sharded[fmt.LOGPROBS], single[fmt.LOGPROBS], atol=1e-6, rtol=0)
        assert torch.equal(sharded[fmt.IDS][clear], ids[clear])
        torch.testing.assert_close(sharded[fmt.LOGPROBS][clear].double(), logprobs[clear], atol=2e-6, rtol=0)
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] < 1e-9, (worst, result["errors"][worst])
