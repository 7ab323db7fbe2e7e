"""What the cache writer reads: documents of one input kind each, one module per kind, and the stream of tokens.

- ``text_documents.py``: JSONL ``{"text": ...}``;
- ``conversation_documents.py``: JSONL ``{"messages": [{"role": ..., "content": ...}, ...]}`` through the
  tokenizer's chat template, the assistant's tokens the loss targets;
- ``pair_documents.py``: JSONL ``{"prompt": ..., "response": ...}``, the response's tokens the loss targets;
- ``indexed_documents.py``: a Megatron indexed dataset with its document index (local, or on object storage through
  ``object_tokens.py``);
- ``document_set.py``: what each of them yields (documents and their loss targets), which ``cache/layouts/`` cuts
  into rows; ``token_windows.py``: the ``stream`` rows (today's windows over the concatenated tokens);
- ``source_files.py``: file hashes, the tokenizer and JSONL records, for all of them.

:func:`open_documents` opens ``--data`` as the kind :func:`resolve_input_kind` finds (or is told).
"""

from __future__ import annotations

from megatron_kd_plugin.cache.sources.conversation_documents import conversation_documents
from megatron_kd_plugin.cache.sources.document_set import DocumentMasks, DocumentSet
from megatron_kd_plugin.cache.sources.indexed_documents import indexed_documents
from megatron_kd_plugin.cache.sources.pair_documents import PAIR_KEYS, pair_documents
from megatron_kd_plugin.cache.sources.source_files import LoadedTokenizer, is_jsonl, jsonl_records
from megatron_kd_plugin.cache.sources.text_documents import text_documents

INPUT_KINDS = ("text", "messages", "prompt_response", "indexed")
"""Every input kind; JSONL files hold the first three, an indexed-dataset prefix the last."""


def input_kind_of(data: str, *, text_key: str = "text") -> str:
    """The input kind of ``data``: ``indexed`` for a prefix, else what the first record's keys say; ValueError
    naming ``file:line`` when they fit none or several kinds."""
    if not is_jsonl(data):
        return "indexed"
    for number, record in jsonl_records(data, progress="reading"):
        keys = set(record) if isinstance(record, dict) else set()
        kinds = [kind for kind, needed in (("messages", {"messages"}), ("prompt_response", set(PAIR_KEYS)),
                                           ("text", {text_key})) if needed <= keys]
        if len(kinds) != 1:
            found = "fit none" if not kinds else f"fit several ({kinds})"
            raise ValueError(f"{data}:{number}: the keys {sorted(keys)} {found} of the JSONL input kinds ('messages'; "
                             f"'prompt' and 'response'; {text_key!r}): pass the input kind")
        return kinds[0]
    raise ValueError(f"{data} holds no document (no non-blank line)")


def resolve_input_kind(data: str, input_kind: str = "auto", *, text_key: str = "text") -> str:
    """``input_kind``, or with ``auto`` the kind :func:`input_kind_of` finds; ValueError for an unknown kind and for
    one the data cannot hold (JSONL kinds need a .jsonl/.json file, ``indexed`` a prefix)."""
    if input_kind == "auto":
        return input_kind_of(data, text_key=text_key)
    if input_kind not in INPUT_KINDS:
        raise ValueError(f"input kind {input_kind!r}; choose one of {['auto', *INPUT_KINDS]}")
    if (input_kind == "indexed") == is_jsonl(data):
        holds = "a JSONL file" if is_jsonl(data) else "an indexed-dataset prefix (no .jsonl/.json name)"
        raise ValueError(f"input kind {input_kind!r}: {data} is {holds}")
    return input_kind


def check_masks(input_kind: str, masks: DocumentMasks) -> None:
    """ValueError (one line) for a mask setting that changes nothing for documents of ``input_kind``."""
    if masks.prompt_loss and input_kind in ("text", "indexed"):
        raise ValueError(f"prompt_loss applies to conversations and prompt/response pairs: every token of "
                         f"{input_kind} documents is a loss target already")
    if not masks.eod_loss and input_kind == "messages" and not masks.prompt_loss:
        raise ValueError("eod_loss=0 changes nothing for conversations: the end-of-document id after one is a loss "
                         "target only with prompt_loss")


def open_documents(data: str, tokenizer: LoadedTokenizer, *, input_kind: str, text_key: str = "text",
                   masks: DocumentMasks = DocumentMasks()) -> DocumentSet:
    """The documents of ``data`` read as ``input_kind`` (one of :data:`INPUT_KINDS`)."""
    check_masks(input_kind, masks)
    if input_kind == "indexed":
        return indexed_documents(data, tokenizer, masks=masks)
    if input_kind == "text":
        return text_documents(data, tokenizer, text_key=text_key, masks=masks)
    if input_kind == "messages":
        return conversation_documents(data, tokenizer, masks=masks)
    if input_kind == "prompt_response":
        return pair_documents(data, tokenizer, masks=masks)
    raise ValueError(f"input kind {input_kind!r}; choose one of {list(INPUT_KINDS)}")


__all__ = ["DocumentMasks", "DocumentSet", "INPUT_KINDS", "check_masks", "input_kind_of", "open_documents",
           "resolve_input_kind"]
