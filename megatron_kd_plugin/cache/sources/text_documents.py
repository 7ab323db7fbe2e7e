"""JSONL text: one document per line, ``{"text": "..."}``, tokenized and followed by the tokenizer's
end-of-document id (when it has one). Every token is a loss target, the end-of-document id too unless
``DocumentMasks.eod_loss`` is off (``document_set.py``'s text rule)."""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.sources.document_set import DocumentMasks, DocumentSet
from megatron_kd_plugin.cache.sources.source_files import LoadedTokenizer, file_digest, jsonl_records, string_field


def text_documents(path: str, tokenizer: LoadedTokenizer, *, text_key: str = "text",
                   masks: DocumentMasks = DocumentMasks()) -> DocumentSet:
    """The documents ``json[text_key]`` of the JSONL file ``path``; ValueError naming ``path:line`` for a line
    without that string, and for a file without one."""
    pieces, lines = [], []
    suffix = [] if tokenizer.eod_id is None else [tokenizer.eod_id]
    for number, record in jsonl_records(path):
        pieces.append(np.asarray(tokenizer.encode(string_field(record, text_key, f"{path}:{number}")) + suffix,
                                 dtype=np.int64))
        lines.append(number)
    if not pieces:
        raise ValueError(f"{path} holds no document (no non-blank line)")
    offsets = np.concatenate([[0], np.cumsum([len(piece) for piece in pieces])]).astype(np.int64)
    return DocumentSet(kind="text", tokens=np.concatenate(pieces), offsets=offsets, targets=None, appended=None,
                       eod_id=tokenizer.eod_id, masks=masks,
                       content=lambda: file_digest([path], extra=tokenizer.identity), tokenizer=tokenizer.identity,
                       tokenizer_vocab_size=tokenizer.vocab_size, name=str(path), lines=np.asarray(lines, np.int64))
