"""The row layouts of ``cache/layouts/``: packed and per-document rows read back against their documents (every
token once and in order, positions restarting per document, the loss targets carried, padding, the packing
figures), the stream layout unchanged, and every refusal."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from megatron_kd_plugin.cache.layouts import open_rows
from megatron_kd_plugin.cache.layouts.packed_layout import best_fit_decreasing
from megatron_kd_plugin.cache.layouts.planned_rows import PlannedRows, split_pieces
from megatron_kd_plugin.cache.sources import DocumentMasks, DocumentSet
from megatron_kd_plugin.cache.sources.token_windows import open_source
from tests.chat_tokenizers import PLAIN_TEMPLATE, save_tokenizer, save_tokenizer_json

EOD = 0


def synthetic(lengths, *, targets=None, seed=0) -> DocumentSet:
    """Documents of ``lengths`` tokens, each token id unique (1, 2, ...) but the closing EOD; ``targets``: their
    probability of being a loss target (None: the text rule)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = np.arange(1, lengths.sum() + 1, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens[offsets[1:] - 1] = EOD
    chosen = None if targets is None else \
        (np.random.default_rng(seed).random(len(tokens)) < targets).astype(np.uint8)
    return DocumentSet(kind="text" if targets is None else "messages", tokens=tokens, offsets=offsets,
                       targets=chosen, appended=None, eod_id=EOD, masks=DocumentMasks(), content=lambda: "synthetic",
                       tokenizer="synthetic", tokenizer_vocab_size=int(lengths.sum()) + 1, name="synthetic.jsonl",
                       lines=np.arange(1, len(lengths) + 1))


def planned(documents, seq_length, layout="packed", **options) -> PlannedRows:
    from megatron_kd_plugin.cache.layouts.document_layout import one_per_row

    place = best_fit_decreasing if layout == "packed" else one_per_row
    return PlannedRows(documents, seq_length, layout=layout, place=place, split=options.pop("split", True),
                       num_samples=options.pop("num_samples", None))


def read_back(rows, documents) -> tuple[collections.Counter, collections.Counter, np.ndarray]:
    """Parses every row by its position_ids alone and checks each run against the documents: a piece's tokens are
    its document's from a multiple of S, positions 0.., each counted label the document's next token; padding is
    the row's last run, EOD, never counted. Returns (non-EOD input tokens seen, labels counted as (document, index)),
    and the tokens of all rows."""
    s = rows.seq_length
    tokens = rows.windows(0, len(rows))
    loss, positions = rows.row_masks(0, len(rows))
    assert tokens.shape == (len(rows), s + 1) and loss.shape == positions.shape == (len(rows), s)
    assert loss.dtype == np.uint8 and positions.dtype == np.int32 and tokens.dtype == np.int64
    owner = {int(t): (d, i) for d in range(len(documents)) for i, t in
             enumerate(documents.tokens[documents.offsets[d]:documents.offsets[d + 1]]) if t != EOD}
    seen, counted = collections.Counter(), collections.Counter()
    for r in range(len(rows)):
        starts = np.flatnonzero(positions[r] == 0).tolist()
        for a, b in zip(starts, starts[1:] + [s]):
            if tokens[r, a] == EOD:                                                      # padding
                assert b == s and (tokens[r, a:] == EOD).all() and not loss[r, a:].any()
                continue
            d, first = owner[int(tokens[r, a])]
            stored = documents.tokens[documents.offsets[d]:documents.offsets[d + 1]]
            assert first % s == 0 and (positions[r, a:b] == np.arange(b - a)).all()
            assert (tokens[r, a:b] == stored[first:first + b - a]).all()
            seen.update(int(t) for t in tokens[r, a:b] if t != EOD)
            for j in np.flatnonzero(loss[r, a:b]).tolist():
                assert tokens[r, a + j + 1] == stored[first + j + 1]
                counted[(d, first + j + 1)] += 1
    return seen, counted, tokens


def target_labels(documents) -> collections.Counter:
    """Every label of every document that is a loss target, once."""
    expected = collections.Counter()
    for d in range(len(documents)):
        begin, end = documents.offsets[d], documents.offsets[d + 1]
        _, targets = documents.pieces(np.array([d]), np.array([0]), np.array([end - begin]))
        expected.update((d, i) for i in range(1, end - begin) if targets[i])
    return expected


def pieces_tokens(lengths, s: int) -> int:
    """Token slots the pieces of documents of ``lengths`` fill (split pieces share one token)."""
    return sum(n + (max(1, -(-(n - 1) // s)) - 1 if n > s + 1 else 0) for n in lengths)


def test_packed_rows_hold_every_document_once_in_order_with_positions_restarting():
    lengths = np.random.default_rng(3).integers(2, 40, 60).tolist() + [75, 33, 17]      # some longer than a row
    documents = synthetic(lengths)
    rows = planned(documents, 16)
    seen, counted, tokens = read_back(rows, documents)
    assert seen == collections.Counter({t: 1 for t in documents.tokens.tolist() if t != EOD})
    assert counted == target_labels(documents)
    total = pieces_tokens(lengths, 16)
    assert rows.packing == {"documents": len(lengths), "pieces": len(split_pieces(documents.lengths, 16)[0]),
                            "split": sum(n > 17 for n in lengths), "dropped": 0, "efficiency": total / (len(rows) * 17)}
    assert len(rows) <= np.ceil(total / 17) * 11 / 9 + 1                             # FFD's bound
    again = planned(synthetic(lengths), 16)
    assert (again.windows(0, len(again)) == tokens).all()
    assert all((a == b).all() for a, b in zip(again.row_masks(0, len(rows)), rows.row_masks(0, len(rows))))
    assert rows.summary == again.summary and rows.summary.low == EOD and rows.summary.high == documents.tokens.max()


def test_packed_rows_carry_conversation_targets_and_drop_pieces_with_none():
    documents = synthetic(np.random.default_rng(5).integers(2, 30, 40), targets=0.6, seed=5)
    rows = planned(documents, 12)
    _, counted, _ = read_back(rows, documents)
    assert counted == target_labels(documents)                   # prompt labels never counted, assistant ones once
    quiet = synthetic([20, 6], targets=0.0)
    quiet.targets[quiet.offsets[1] + 1] = 1                       # the second document's first label only
    rows = planned(quiet, 8)
    assert rows.packing["dropped"] == 3 and rows.packing["pieces"] == 1 and len(rows) == 1
    loss, positions = rows.row_masks(0, 1)
    assert loss[0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0] and positions[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    with pytest.raises(ValueError, match="synthetic.jsonl: no document has a loss target in any row"):
        planned(synthetic([5, 6], targets=0.0), 8)


def test_best_fit_decreasing_fills_rows_tightly_and_numbers_them_by_first_piece():
    rows = best_fit_decreasing(np.array([2, 6, 5, 4, 3, 2]), 8)
    assert rows.tolist() == [0, 0, 1, 2, 1, 2]                     # 6+2, 5+3, 4+2: 24 slots for 22 tokens
    assert best_fit_decreasing(np.array([8, 8, 8]), 8).tolist() == [0, 1, 2]


def test_document_rows_are_one_document_padded_and_refuse_longer_ones_unless_split():
    documents = synthetic([5, 9, 2])
    rows = planned(documents, 8, layout="document", split=False)
    seen, counted, tokens = read_back(rows, documents)
    assert counted == target_labels(documents) and len(rows) == 3
    loss, positions = rows.row_masks(0, 3)
    assert tokens[0].tolist() == [1, 2, 3, 4, EOD, EOD, EOD, EOD, EOD]
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and loss[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert loss[1].tolist() == [1] * 8 and positions[1].tolist() == list(range(8))      # 9 tokens: a full row
    assert rows.packing["efficiency"] == 16 / 27
    with pytest.raises(ValueError, match=r"synthetic.jsonl:2: a document of 12 tokens is longer than a row of "
                                         r"seq_length=8 \(\+1\) \(1 such documents\)"):
        planned(synthetic([5, 12]), 8, layout="document", split=False)
    rows = planned(synthetic([5, 12]), 8, layout="document", split=True)
    assert len(rows) == 3 and rows.packing["split"] == 1
    assert counted == target_labels(documents)
    with pytest.raises(ValueError, match="num_samples=4: synthetic.jsonl fills 3 document rows"):
        planned(synthetic([5, 12]), 8, layout="document", split=True, num_samples=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """{"text", "chat": JSONL files; "tokenizer": a tokenizer.json; "chat_tokenizer": a folder with a template}."""
    folder = tmp_path_factory.mktemp("layouts")
    texts = ["the cat sat.", "a dog ran far away.", "hi", "more words here, and more."] * 3
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    chats = [[{"role": "user", "content": f"say {t}"}, {"role": "assistant", "content": t}] for t in texts]
    (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return {"text": str(folder / "text.jsonl"), "chat": str(folder / "chat.jsonl"),
            "tokenizer": save_tokenizer_json(folder / "tokenizer.json"),
            "chat_tokenizer": save_tokenizer(folder / "chat_tokenizer", PLAIN_TEMPLATE)}


def test_stream_is_the_default_for_text_and_unchanged(data):
    rows = open_rows(data["text"], 16, tokenizer=data["tokenizer"])
    windows = open_source(data["text"], 16, tokenizer=data["tokenizer"])
    assert rows.layout == "stream" and rows.packing == {} and rows.summary == windows.summary
    assert (rows.windows(0, len(rows)) == windows.windows(0, len(windows))).all()
    loss, positions = rows.row_masks(1, 3)
    assert (loss == 1).all() and (positions == np.arange(16)).all() and positions.dtype == np.int32


def test_layouts_and_mask_settings_make_different_stores(data):
    text = dict(tokenizer=data["tokenizer"])
    fingerprints = {open_rows(data["text"], 32, layout=layout, eod_loss=eod_loss, **text).fingerprint
                    for layout in ("packed", "document") for eod_loss in (True, False)}
    fingerprints.add(open_rows(data["text"], 32, **text).fingerprint)
    assert len(fingerprints) == 5
    chat = open_rows(data["chat"], 64, tokenizer=data["chat_tokenizer"])
    assert chat.layout == "packed" and chat.packing["documents"] == 12 and 0 < chat.packing["efficiency"] <= 1
    loss, _ = chat.row_masks(0, len(chat))
    assert 0 < loss.sum() < loss.size / 2                    # assistant tokens only: the answers and end-of-turn


REFUSED = {
    "stream of conversations": (dict(data="chat", layout="stream"), "layout 'stream' has no loss mask"),
    "stream with eod_loss": (dict(layout="stream", eod_loss=False), "the 'stream' layout counts every label"),
    "packed with split": (dict(layout="packed", split_documents=True), "splitting documents applies to the "
                                                                      "'document' layout"),
    "no tokenizer": (dict(layout="packed", tokenizer=None), "layout 'packed' needs --tokenizer"),
    "unknown layout": (dict(layout="rows"), "layout 'rows'; choose one of"),
    "too long": (dict(layout="document", seq_length=8), r"text.jsonl:1: a document of 13 tokens is longer"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_in_one_line(data, case):
    options, message = REFUSED[case]
    options = {"data": "text", "seq_length": 16, "tokenizer": data["tokenizer"], **options}
    path, seq_length = data[options.pop("data")], options.pop("seq_length")
    if case == "stream of conversations":
        options["tokenizer"] = data["chat_tokenizer"]
    with pytest.raises(ValueError, match=message):
        open_rows(path, seq_length, **options)
