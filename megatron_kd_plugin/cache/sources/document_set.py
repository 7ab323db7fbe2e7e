"""The documents of a source, each with the loss targets of its tokens: what every input kind yields and every
layout reads (``cache/layouts/``).

A document is a run of token ids ending with the tokenizer's end-of-document id. Its *targets* say, per token,
whether that token counts as a label (1) or not (0); a row's ``loss_mask[t]`` is then the target of
``tokens[t + 1]`` when it lies in the same document, and 0 at a document's last token (its label would be the next
document's first token, or padding). A document's first token is never a label, so its target is unused.

Tokens lie back to back in one 1-D array (JSONL sources: in memory; indexed datasets: the memory-mapped ``.bin`` or
its object-storage ranges), document ``d`` at ``offsets[d]:offsets[d+1]``, plus one end-of-document id appended
where ``appended[d]`` (an indexed dataset's document stored without one). Targets are either stored beside the
tokens (conversations, prompt/response pairs) or the text rule: every token a target but the last one's, which is
one when ``eod_loss``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True, kw_only=True)
class DocumentMasks:
    """Which tokens of a document are loss targets (its labels that count)."""

    eod_loss: bool = True
    """The end-of-document id that ends a text, indexed or prompt/response document is a target (the model learns
    where a document ends). False: it is not, as Megatron's ``eod_mask_loss``; the label after it (the next
    document's first token) never is, in any documents layout."""
    prompt_loss: bool = False
    """Conversations and prompt/response pairs: every token of the document is a target, the prompt's (system,
    user, tool turns, the template's markup) too. False: the assistant's / the response's tokens only."""

    def describe(self) -> str:
        """The settings, as the fingerprint records them."""
        return f"eod_loss={int(self.eod_loss)},prompt_loss={int(self.prompt_loss)}"


@dataclass(eq=False, kw_only=True)
class DocumentSet:
    """``len(offsets) - 1`` documents (see the module docstring) and what the store records of their source."""

    kind: str
    """The input kind (``sources.INPUT_KINDS``)."""
    tokens: object
    """int [T]: the stored tokens of every document, back to back (an array, a memmap or ``RangedTokens``)."""
    offsets: np.ndarray
    """int64 [D + 1]: document ``d`` is stored at ``tokens[offsets[d]:offsets[d + 1]]``."""
    targets: np.ndarray | None
    """uint8 [T], 1 = that token is a loss target; None: the text rule (module docstring)."""
    appended: np.ndarray | None
    """bool [D]: document ``d`` is followed by one end-of-document id not stored in ``tokens``; None: none is."""
    eod_id: int | None
    """The end-of-document id (also the padding id of per-document rows); None when the tokenizer has none."""
    masks: DocumentMasks
    content: Callable[[], str]
    """Computes the content hash of the source (its files, the tokenizer and what renders the documents)."""
    tokenizer: str
    """The tokenizer's identity."""
    tokenizer_vocab_size: int | None
    name: str
    """The source, as messages name it (a file name, a .bin)."""
    lines: np.ndarray | None = None
    """int64 [D]: the JSONL line of each document; None for an indexed dataset."""

    def __post_init__(self):
        if len(self.offsets) < 2:
            raise ValueError(f"{self.name} holds no document")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def where(self, document: int) -> str:
        """Document ``document`` as a message names it (``file:line``, or its index in an indexed dataset)."""
        if self.lines is not None:
            return f"{self.name}:{int(self.lines[document])}"
        return f"{self.name} document {document}"

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """int64 [D]: tokens per document, its end-of-document id included."""
        stored = np.diff(self.offsets)
        return stored if self.appended is None else stored + self.appended

    def pieces(self, documents: np.ndarray, begins: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens and targets of the pieces ``documents[i][begins[i] : begins[i] + lengths[i]]``, concatenated.

        Shape: documents, begins, lengths int64 [P] -> (tokens int64 [sum(lengths)], targets uint8 [sum(lengths)]).
        """
        if len(documents) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.uint8)
        starts = self.offsets[documents] + begins
        stored = np.minimum(lengths, self.offsets[documents + 1] - starts)      # the rest: one appended eod
        tokens = np.concatenate([part for a, n, m in zip(starts.tolist(), stored.tolist(), lengths.tolist())
                                 for part in (np.asarray(self.tokens[a:a + n], dtype=np.int64),
                                              np.full(m - n, self.eod_id, dtype=np.int64))])
        within = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)   # index in the piece
        if self.targets is None:
            last = np.repeat(begins + lengths == self.lengths[documents], lengths) & \
                (within == np.repeat(lengths - 1, lengths))
            targets = np.where(last, np.uint8(self.masks.eod_loss), np.uint8(1)).astype(np.uint8)
        else:
            targets = self.targets[np.repeat(starts, lengths) + within]
        return tokens, targets

    def label_targets(self, documents: np.ndarray, begins: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """int64 [P]: how many labels of each piece (its tokens after the first) are loss targets."""
        labels = np.maximum(lengths - 1, 0)
        if self.targets is None:
            return labels - ((begins + lengths == self.lengths[documents]) & (lengths > 1) & (not self.masks.eod_loss))
        counted = np.concatenate([[0], np.cumsum(self.targets, dtype=np.int64)])
        starts = self.offsets[documents] + begins
        return counted[starts + lengths] - counted[np.minimum(starts + 1, starts + lengths)]
