"""Rows made of whole documents: the row source of the ``packed`` and ``document`` layouts.

A row has ``S + 1`` token slots (its tokens; the labels are ``tokens[1:]``). A layout places *pieces* in rows: a
document that fits a row (at most ``S + 1`` tokens) is one piece, a longer one (where the layout splits) is cut
like the stream layout cuts its stream, ``doc[k·S : k·S + S + 1]``, so consecutive pieces share one token and each
label of the document is in exactly one piece. A piece is a document of its row: positions restart at 0 at its
first token and its loss mask is its tokens' targets shifted by one (``sources/document_set.py``), 0 at its last
token. The slots after a row's last piece are padding, the end-of-document id, positions 0.. again, loss mask 0.

A piece none of whose labels is a loss target (an all-prompt piece of a split conversation, an empty text) would
cost the teacher a forward and the store its bytes for nothing: it is dropped, and ``packing["dropped"]`` counts
them. Rows hold per-piece arrays only (document, first token, length; rows as offsets into them): ``[b, S + 1]``
arrays exist only for the rows asked for.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable

import numpy as np

from megatron_kd_plugin.cache.sources.document_set import DocumentSet
from megatron_kd_plugin.cache.sources.token_windows import RowSource, SourceSummary

_BLOCK_SLOTS = 1 << 24
"""Token slots read at a time when the rows are scanned for their token range."""

Placement = Callable[[np.ndarray, int], np.ndarray]
"""(piece lengths int64 [P], row capacity S + 1) -> the row of each piece, int64 [P], rows numbered 0..R-1 in the
order of their first piece; pieces keep their order within a row."""


def split_pieces(lengths: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document, first token, length) of every piece, each int64 [P], documents in order (module docstring).

    Shape: lengths int64 [D] (tokens per document) -> three int64 [P].
    """
    counts = np.where(lengths > seq_length + 1, -(-(lengths - 1) // seq_length), 1)        # pieces per document
    documents = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    index = np.arange(len(documents), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    begins = index * seq_length
    return documents, begins, np.minimum(lengths[documents] - begins, seq_length + 1)


class PlannedRows(RowSource):
    """``len(self)`` rows of pieces of ``documents`` (module docstring), a row source of the cache writer."""

    def __init__(self, documents: DocumentSet, seq_length: int, *, layout: str, place: Placement, split: bool,
                 num_samples: int | None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.documents, self.seq_length, self.layout, self.split = documents, seq_length, layout, split
        self.tokenizer, self.tokenizer_vocab_size = documents.tokenizer, documents.tokenizer_vocab_size
        self.name, self.pad_id = documents.name, documents.eod_id
        docs, begins, lengths = self._pieces()
        kept = documents.label_targets(docs, begins, lengths) > 0
        if not kept.any():
            raise ValueError(f"{documents.name}: no document has a loss target in any row of seq_length={seq_length}")
        docs, begins, lengths = docs[kept], begins[kept], lengths[kept]
        rows = place(lengths, seq_length + 1)
        order = np.lexsort((np.arange(len(rows)), rows))                   # by row, pieces in their order within it
        offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=int(rows.max()) + 1))])
        available = len(offsets) - 1
        if num_samples is None:
            num_samples = available
        if num_samples < 1 or num_samples > available:
            raise ValueError(f"num_samples={num_samples}: {documents.name} fills {available} {layout} rows of "
                             f"seq_length={seq_length} (+1)")
        used = slice(0, int(offsets[num_samples]))
        self.piece_documents, self.piece_begins, self.piece_lengths = \
            docs[order][used], begins[order][used], lengths[order][used]
        self.row_offsets, self.num_samples = offsets[:num_samples + 1], num_samples
        self.packing = self._packing(dropped=int((~kept).sum()))
        self._last_rows: tuple = (None, None)

    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every piece of every document; ValueError naming the first document longer than a row unless the
        layout splits."""
        lengths = self.documents.lengths
        too_long = np.flatnonzero(lengths > self.seq_length + 1)
        if len(too_long) and not self.split:
            first = int(too_long[0])
            raise ValueError(f"{self.documents.where(first)}: a document of {int(lengths[first])} tokens is longer "
                             f"than a row of seq_length={self.seq_length} (+1) ({len(too_long)} such documents): "
                             "raise the seq_length or ask for splitting documents")
        return split_pieces(lengths, self.seq_length)

    def _packing(self, *, dropped: int) -> dict:
        """How the documents fill the rows (what the store records and the cache command prints)."""
        documents = np.unique(self.piece_documents)
        split = int((self.documents.lengths[documents] > self.seq_length + 1).sum())
        return {"documents": int(len(documents)), "pieces": int(len(self.piece_documents)), "split": split,
                "dropped": dropped,
                "efficiency": float(self.piece_lengths.sum() / (self.num_samples * (self.seq_length + 1)))}

    def __len__(self) -> int:
        return self.num_samples

    def windows(self, begin: int, end: int) -> np.ndarray:
        """int64 ``[b, S + 1]``: the tokens of rows begin..end-1, b = end - begin."""
        return self._cached_rows(begin, end)[0]

    def row_masks(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(loss_mask uint8 ``[b, S]``, position_ids int32 ``[b, S]``) of rows begin..end-1 (module docstring)."""
        return self._cached_rows(begin, end)[1:]

    def _cached_rows(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_rows`, the last block kept (the writer asks a shard's windows, then its masks)."""
        if self._last_rows[0] != (begin, end):
            self._last_rows = ((begin, end), self._rows(begin, end))
        return self._last_rows[1]

    def _rows(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int64 [b, S + 1], loss_mask uint8 [b, S], position_ids int32 [b, S]) of rows begin..end-1."""
        s, b = self.seq_length, end - begin
        first, last = int(self.row_offsets[begin]), int(self.row_offsets[end])
        docs, begins, lengths = (array[first:last] for array in
                                 (self.piece_documents, self.piece_begins, self.piece_lengths))
        values, targets = self.documents.pieces(docs, begins, lengths)
        pieces_per_row = np.diff(self.row_offsets[begin:end + 1])
        row_of_piece = np.repeat(np.arange(b, dtype=np.int64), pieces_per_row)
        piece_end = np.cumsum(lengths)                                         # slots, counted over all b rows
        row_start = np.concatenate([[0], piece_end])[np.cumsum(pieces_per_row) - pieces_per_row]
        slot_of_piece = piece_end - lengths - np.repeat(row_start, pieces_per_row)
        within = np.arange(len(values), dtype=np.int64) - np.repeat(piece_end - lengths, lengths)
        row, slot = np.repeat(row_of_piece, lengths), np.repeat(slot_of_piece, lengths) + within
        tokens = np.full((b, s + 1), self.pad_id, dtype=np.int64)
        tokens[row, slot] = values
        label = np.zeros((b, s + 1), dtype=np.uint8)          # label[r, t]: tokens[r, t + 1] is a loss target
        later = within > 0
        label[row[later], slot[later] - 1] = targets[later]
        filled = np.zeros(b, dtype=np.int64)
        np.add.at(filled, row_of_piece, lengths)
        slots = np.arange(s + 1, dtype=np.int64)[None, :]
        positions = slots - filled[:, None]                                   # padding: its own run from 0
        positions[row, slot] = within
        return tokens, label[:, :s], positions[:, :s].astype(np.int32)

    @functools.cached_property
    def summary(self) -> SourceSummary:
        """The rows' fingerprint (content, layout, masks, seq_length, row count) and token range."""
        settings = (f"{self.documents.content()}|kind={self.documents.kind}|layout={self.layout}|"
                    f"split={int(self.split)}|{self.documents.masks.describe()}|S={self.seq_length}|"
                    f"N={self.num_samples}")
        low, high, block = None, None, max(1, _BLOCK_SLOTS // (self.seq_length + 1))
        for begin in range(0, self.num_samples, block):
            tokens = self.windows(begin, min(begin + block, self.num_samples))
            low = int(tokens.min()) if low is None else min(low, int(tokens.min()))
            high = int(tokens.max()) if high is None else max(high, int(tokens.max()))
        return SourceSummary(hashlib.sha256(settings.encode()).hexdigest(), low, high)
