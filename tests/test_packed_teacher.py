"""Packed rows through the cache tool: every document attended alone, against transformers' own forward of it alone.

One spawn of two gloo ranks runs the tool's command body (``commands.cache.run``) on a row source of documents packed
by hand (:class:`HandPackedRows`, a test-local row source as the writer's contract describes; the tool's data
options are bypassed by handing ``run`` this source): a tiny random-init HF Qwen3 teacher at TP=1 (DP=2), TP=2 and
PP=2, a tiny Qwen3-MoE at EP=2, a tiny gpt-oss (a sliding window of 4 on its first layer) at TP=1, and the same windows as one stream. The parent compares the log-probs of every
document of every row with transformers' float64 forward of that document alone (at its tokens of loss mask 1; its
last token holds padding slots), checks that the store's loss mask
and positions round-trip, and that the stream store (the teacher attending across documents: issue #49's bug)
differs from it at every document after a row's first. Without a spawn (a context-free table teacher): ``--repair``
of a damaged ``loss_mask`` shard is byte-identical, and a version-5 reader refuses a documents store by its version.
"""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest
import torch

from tests.distributed import run_on_ranks
from tests.hf_models import hf_logits

S, K, EOD = 16, 8, 0
ROWS = [[5, 7, 4], [9, 7], [16], [3, 6, 7]]          # document lengths of each row (each row exactly S tokens)
COMMON = ["--seq-length", str(S), "--topk", str(K), "--samples-per-shard", "2", "--micro-batch-size", "2",
          "--logprob-codec", "fp32", "--store-logsumexp", "--no-progress"]
LAYOUTS = {          # store name: (teacher, layout of the rows, extra flags); world = 2 ranks
    "dense_tp1": ("dense", "packed", []),
    "dense_tp2": ("dense", "packed", ["--tp", "2"]),
    "dense_pp2": ("dense", "packed", ["--pp", "2"]),
    "moe_ep2": ("moe", "packed", ["--ep", "2"]),
    "gpt_oss_tp1": ("gpt_oss", "packed", []),       # sliding window 4 on layer 0: the window within each document
    "dense_stream": ("dense", "stream", []),
}


class HandPackedRows:
    """A row source (the writer's contract) of documents packed by hand: row i holds documents of ``ROWS[i]``
    tokens, each ending with ``EOD``; positions restart at every document; a document's last position has loss mask 0
    (its label is the next document's first token). ``layout="stream"``: the same windows as one stream (loss mask
    all ones, positions 0..S-1), what today's tool caches."""

    seq_length, tokenizer, tokenizer_vocab_size, name = S, "hand-packed", None, "hand-packed documents"

    def __init__(self, layout: str):
        rng = np.random.default_rng(0)
        self.layout = layout
        self.documents = [[np.append(rng.integers(2, 512, length - 1), EOD) for length in row] for row in ROWS]
        self.tokens = np.stack([np.append(np.concatenate(row), EOD) for row in self.documents])      # [N, S+1]
        self.packing = {"documents": sum(map(len, ROWS)), "efficiency": 1.0} if layout != "stream" else {}
        self.position_ids = np.stack([np.concatenate([np.arange(len(d)) for d in row]) for row in self.documents])
        self.loss_mask = np.stack([np.concatenate([np.arange(len(d)) < len(d) - 1 for d in row])
                                   for row in self.documents]).astype(np.uint8)
        if layout == "stream":
            self.position_ids = np.broadcast_to(np.arange(S), self.tokens[:, 1:].shape).copy()
            self.loss_mask = np.ones_like(self.loss_mask)
        from megatron_kd_plugin.cache.sources.token_windows import SourceSummary

        digest = hashlib.sha256(self.tokens.tobytes() + layout.encode()).hexdigest()
        self.summary = SourceSummary(digest, int(self.tokens.min()), int(self.tokens.max()))

    def __len__(self) -> int:
        return len(ROWS)

    @property
    def fingerprint(self) -> str:
        return self.summary.fingerprint

    def token_range(self) -> tuple[int, int]:
        return self.summary.low, self.summary.high

    def windows(self, begin: int, end: int) -> np.ndarray:
        return self.tokens[begin:end].astype(np.int64)

    def row_masks(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.loss_mask[begin:end].copy(), self.position_ids[begin:end].astype(np.int32)


def _write_stores(teachers: dict, work: str) -> None:
    """Every store of LAYOUTS, written by the command body on this rank (its data source: :class:`HandPackedRows`)."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.commands import cache as command
    from megatron_kd_plugin.commands.cache import parse_args, run

    parallel_state.destroy_model_parallel()            # run_on_ranks' TP=1 state: each store makes its own
    for name, (teacher, layout, flags) in LAYOUTS.items():
        command.open_rows = lambda *args, rows=HandPackedRows(layout), **kwargs: rows
        run(parse_args(["--teacher", teachers[teacher], "--data", f"{work}/unused.jsonl",
                        "--output", f"{work}/{name}.zarr", *COMMON, *flags]))


@pytest.fixture(scope="module")
def stores(tiny_hf_qwen3, tiny_hf_qwen3_moe, tiny_hf_gpt_oss, tmp_path_factory):
    """({store name: reader}, {teacher: float64 log-probs of every document alone, [row][document] -> [len, V]})."""
    from megatron_kd_plugin.cache import TopKCacheReader

    work = tmp_path_factory.mktemp("packed_teacher")
    teachers = dict(dense=str(tiny_hf_qwen3), moe=str(tiny_hf_qwen3_moe), gpt_oss=str(tiny_hf_gpt_oss))
    (work / "unused.jsonl").write_text('{"text": "the --data the command checks; its rows are HandPackedRows"}\n')
    run_on_ranks(2, _write_stores, teachers, str(work), tp=1, timeout=600)
    rows = HandPackedRows("packed")
    alone = {name: [[torch.log_softmax(hf_logits(folder, torch.from_numpy(doc)[None])[0], -1) for doc in row]
                    for row in rows.documents] for name, folder in teachers.items()}
    return {name: TopKCacheReader(work / f"{name}.zarr") for name in LAYOUTS}, alone, rows


def _document_logprobs(sample, documents) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(stored top-K log-probs [len, K], their ids [len, K])] of each document of a cached sample."""
    spans = np.cumsum([0] + [len(d) for d in documents])
    return [(sample.teacher.logprobs[a:b].double(), sample.teacher.ids[a:b]) for a, b in zip(spans[:-1], spans[1:])]


@pytest.mark.parametrize("name", ["dense_tp1", "dense_tp2", "dense_pp2", "moe_ep2", "gpt_oss_tp1"])
def test_every_document_of_a_packed_row_equals_transformers_forward_of_it_alone(stores, name):
    readers, alone, rows = stores
    reference = alone[LAYOUTS[name][0]]
    for i, documents in enumerate(rows.documents):
        for doc, (logprobs, ids) in enumerate(_document_logprobs(readers[name][i], documents)):
            read = reference[i][doc][:-1]           # a document's last token (loss mask 0) holds padding slots
            expected = read.gather(1, ids[:-1])                                              # [len - 1, K]
            assert torch.allclose(logprobs[:-1], expected, atol=2e-5, rtol=0), (name, i, doc)
            assert torch.equal(ids[:-1].sort(1).values, read.topk(K).indices.sort(1).values), (name, i, doc)
            assert not ids[-1].any() and torch.isneginf(logprobs[-1]).all(), (name, i, doc)


def test_the_store_records_the_layout_loss_mask_positions_and_packing(stores):
    readers, _, rows = stores
    from megatron_kd_plugin.cache.store import format as fmt

    packed, stream = readers["dense_tp1"], readers["dense_stream"]
    assert (packed.spec.layout, packed.group.attrs["version"]) == ("packed", fmt.DOCUMENTS_VERSION)
    assert packed.group.attrs["packing"] == {"documents": sum(map(len, ROWS)), "efficiency": 1.0}
    for i in range(len(rows)):
        assert torch.equal(packed[i].loss_mask, torch.from_numpy(rows.loss_mask[i]))
        assert torch.equal(packed[i].position_ids, torch.from_numpy(rows.position_ids[i]).long())
    # a stream store is version 5, as before: no layout attribute, no mask arrays; it reads all ones and 0..S-1
    assert stream.group.attrs["version"] == fmt.FORMAT_VERSION and "layout" not in stream.group.attrs
    assert fmt.LOSS_MASK not in stream.group and fmt.POSITION_IDS not in stream.group
    assert torch.equal(stream[0].loss_mask, torch.ones(S, dtype=torch.uint8))
    assert torch.equal(stream[0].position_ids, torch.arange(S))


def test_a_stream_store_of_the_same_windows_differs_at_every_later_document(stores):
    """The bug of issue #49: cached as one stream, the teacher attends to the documents before."""
    readers, alone, rows = stores
    for i, documents in enumerate(rows.documents):
        per_document = _document_logprobs(readers["dense_stream"][i], documents)
        for doc, (logprobs, ids) in enumerate(per_document):
            error = float((logprobs - alone["dense"][i][doc].gather(1, ids)).abs().max())
            assert (error < 2e-5) == (doc == 0), (i, doc, error)


def _table_teacher():
    """A context-free teacher: each token's logits a fixed row of a random table (the same rows packed or not)."""
    table = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0))
    return lambda tokens, position_ids: table[tokens].transpose(0, 1)


@pytest.mark.parametrize("kind", ["top-K", "draws", "draws t=0.7", "head + draws"])
def test_tokens_the_loss_does_not_read_hold_padding_slots_the_others_the_teachers_rows(tmp_path, kind):
    """Under each kind's default codec: a packed store holds padding (id 0, log-prob -inf; a draw there weighs 0) at
    every token of loss mask 0 and, at the others, the rows (and weights) of the stream store of the same windows (a
    context-free teacher; draws keyed by sample and position), which keeps every row; ``inspect`` summarises the
    packed store's mask-1 tokens only."""
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.writer import write_cache
    from megatron_kd_plugin.commands.inspect import describe

    kinds = {"top-K": {}, "draws": dict(mode="sampled", sample_seed=5),
             "draws t=0.7": dict(mode="sampled", proposal_temperature=0.7, store_logsumexp=True),
             "head + draws": dict(mode="sampled", head=3)}
    options = dict(k=K, vocab_size=1000, teacher="table", samples_per_shard=2, progress=False, **kinds[kind])
    readers = {}
    for layout in ("packed", "stream"):
        write_cache(HandPackedRows(layout), _table_teacher(), tmp_path / layout, **options)
        readers[layout] = TopKCacheReader(tmp_path / layout)
    for i in range(len(ROWS)):
        packed, stream = readers["packed"][i], readers["stream"][i]
        read = packed.loss_mask.bool()
        assert 0 < int((~read).sum()) == len(ROWS[i])                           # each document's last token
        assert torch.equal(packed.teacher.ids[read], stream.teacher.ids[read])
        assert torch.equal(packed.teacher.logprobs[read], stream.teacher.logprobs[read])
        assert not packed.teacher.ids[~read].any() and torch.isneginf(packed.teacher.logprobs[~read]).all()
        assert torch.isfinite(stream.teacher.logprobs).all()
        if kind != "top-K":                                                        # a SampledTeacher's weights
            assert torch.equal(packed.teacher.weights[read], stream.teacher.weights[read])
            assert not packed.teacher.weights[~read].any() and (stream.teacher.weights[read] > 0).all()
    read = np.stack([readers["packed"][i].loss_mask.numpy() for i in range(len(ROWS))]).ravel() == 1
    (_, packed_stats), (_, stream_stats) = describe(tmp_path / "packed"), describe(tmp_path / "stream")
    for name, values in packed_stats.items():       # inspect summarises the tokens the loss reads, not the padding
        np.testing.assert_allclose(values, stream_stats[name][read])


def test_repair_rewrites_a_damaged_loss_mask_shard_of_a_packed_store_byte_for_byte(tmp_path):
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.writer import write_cache

    teacher = _table_teacher()
    options = dict(k=K, vocab_size=1000, teacher="table", samples_per_shard=2, logprob_codec="fp32", progress=False)
    store = tmp_path / "packed.zarr"
    write_cache(HandPackedRows("packed"), teacher, store, **options)
    clean = {path: path.read_bytes() for path in sorted(store.rglob("*")) if path.is_file()}
    damaged = store / "loss_mask" / "c.1.0"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="loss_mask"):
        [TopKCacheReader(store)[i] for i in (2, 3)]                                    # shard 1: samples 2, 3
    write_cache(HandPackedRows("packed"), teacher, store, repair=True, **options)
    assert {path: path.read_bytes() for path in sorted(store.rglob("*")) if path.is_file()} == clean


def test_a_version_5_reader_refuses_a_packed_store_by_its_version(tmp_path, monkeypatch):
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.cache.writer import write_cache

    write_cache(HandPackedRows("document"), _table_teacher(), tmp_path / "s.zarr", k=K, vocab_size=1000,
                teacher="table", samples_per_shard=2, progress=False)
    assert TopKCacheReader(tmp_path / "s.zarr").spec.layout == "document"
    monkeypatch.setattr(fmt, "READ_VERSIONS", (2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"cache format version 6 is not supported \(this reader reads versions "
                                         r"\(2, 3, 4, 5\)\)"):
        TopKCacheReader(tmp_path / "s.zarr")
