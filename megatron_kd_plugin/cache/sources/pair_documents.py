"""JSONL prompt/response pairs: one document per line, ``{"prompt": "...", "response": "..."}``, the two tokenized
apart and joined as they are (no template: a chat model's format is the ``messages`` kind's), then the
end-of-document id. Loss targets: the response's tokens and the end-of-document id (``DocumentMasks``: every token
with ``prompt_loss``, the end-of-document id only with ``eod_loss``)."""

from __future__ import annotations

import numpy as np

from megatron_kd_plugin.cache.sources.document_set import DocumentMasks, DocumentSet
from megatron_kd_plugin.cache.sources.source_files import LoadedTokenizer, file_digest, jsonl_records, string_field

PAIR_KEYS = ("prompt", "response")


def pair_documents(path: str, tokenizer: LoadedTokenizer, *, masks: DocumentMasks = DocumentMasks()) -> DocumentSet:
    """The prompt/response documents of the JSONL file ``path``; ValueError naming ``path:line`` for a line without
    both strings or with an empty response."""
    eod = tokenizer.require_eod(f"prompt/response pairs ({path})")
    tokens, targets, lines = [], [], []
    for number, record in jsonl_records(path):
        where = f"{path}:{number}"
        prompt, response = (tokenizer.encode(string_field(record, key, where)) for key in PAIR_KEYS)
        if not response:
            raise ValueError(f"{where}: the response is empty: the pair has no token to learn")
        tokens.append(np.asarray(prompt + response + [eod], dtype=np.int64))
        targets.append(np.asarray([masks.prompt_loss] * len(prompt) + [1] * len(response) + [masks.eod_loss],
                                  dtype=np.uint8))
        lines.append(number)
    if not tokens:
        raise ValueError(f"{path} holds no prompt/response pair (no non-blank line)")
    offsets = np.concatenate([[0], np.cumsum([len(piece) for piece in tokens])]).astype(np.int64)
    return DocumentSet(kind="prompt_response", tokens=np.concatenate(tokens), offsets=offsets,
                       targets=np.concatenate(targets), appended=None, eod_id=eod, masks=masks,
                       content=lambda: file_digest([path], extra=tokenizer.identity), tokenizer=tokenizer.identity,
                       tokenizer_vocab_size=tokenizer.vocab_size, name=str(path), lines=np.asarray(lines, np.int64))
