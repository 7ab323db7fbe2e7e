"""JSONL conversations: one document per line, ``{"messages": [{"role": "user", "content": "..."}, ...]}``,
rendered and tokenized by the tokenizer's chat template (``transformers``' ``apply_chat_template``), then the
end-of-document id unless the rendering ends with it.

Loss targets: the assistant's tokens (``DocumentMasks.prompt_loss``: every token). Which tokens are the assistant's
the template says: one with ``{% generation %}`` markers through ``return_assistant_tokens_mask``; one without
them by rendering prefixes: assistant turn ``i`` is the text that ``messages[:i + 1]`` renders beyond
``messages[:i]`` with the generation prompt (so the turn's end-of-turn markup is the assistant's, its header is
not), each token overlapping that text an assistant token. A template whose prefixes do not render as prefixes of
the whole conversation (one that rewrites earlier turns) is refused in one line.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from megatron_kd_plugin.cache.sources.document_set import DocumentMasks, DocumentSet
from megatron_kd_plugin.cache.sources.source_files import LoadedTokenizer, file_digest, jsonl_records

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""
MESSAGE_KEYS = ("role", "content", "name", "tool_call_id")
"""The keys a message may have (``role`` and ``content`` it must)."""
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def conversation_documents(path: str, tokenizer: LoadedTokenizer, *,
                           masks: DocumentMasks = DocumentMasks()) -> DocumentSet:
    """The conversations of the JSONL file ``path``; ValueError (one line) for a tokenizer without a chat template,
    and naming ``path:line`` for a line that is no conversation with an assistant turn."""
    template = chat_template(tokenizer)
    eod = tokenizer.require_eod(f"conversations ({path})")
    render = _marked_tokens if _GENERATION_MARKER.search(template) else _prefix_tokens
    tokens, targets, lines = [], [], []
    for number, record in jsonl_records(path):
        where = f"{path}:{number}"
        ids, assistant = render(tokenizer.hf, checked_messages(record, where), where)
        if not any(assistant):
            raise ValueError(f"{where}: the chat template marks no token of the assistant turns as the assistant's")
        document_targets = [1] * len(ids) if masks.prompt_loss else assistant
        if not ids or ids[-1] != eod:
            ids, document_targets = ids + [eod], document_targets + [int(masks.prompt_loss and masks.eod_loss)]
        tokens.append(np.asarray(ids, dtype=np.int64))
        targets.append(np.asarray(document_targets, dtype=np.uint8))
        lines.append(number)
    if not tokens:
        raise ValueError(f"{path} holds no conversation (no non-blank line)")
    offsets = np.concatenate([[0], np.cumsum([len(piece) for piece in tokens])]).astype(np.int64)
    rendering = f"{tokenizer.identity}|chat_template={hashlib.sha256(template.encode()).hexdigest()}"
    return DocumentSet(kind="messages", tokens=np.concatenate(tokens), offsets=offsets,
                       targets=np.concatenate(targets), appended=None, eod_id=eod, masks=masks,
                       content=lambda: file_digest([path], extra=rendering), tokenizer=tokenizer.identity,
                       tokenizer_vocab_size=tokenizer.vocab_size, name=str(path), lines=np.asarray(lines, np.int64))


def chat_template(tokenizer: LoadedTokenizer) -> str:
    """The tokenizer's chat template; ValueError when it has none."""
    template = getattr(tokenizer.hf, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ValueError(f"tokenizer {tokenizer.identity!r} has no chat template: conversations (`messages`) are "
                         "rendered by one (pass a transformers tokenizer folder or name whose tokenizer_config.json "
                         "or chat_template.jinja holds it)")
    return template


def checked_messages(record, where: str) -> list[dict]:
    """``record["messages"]``; ValueError naming ``where`` unless it is a list of messages of known roles and keys,
    string contents, with an assistant turn."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: not a JSON object with a non-empty 'messages' list")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {turn} is not an object with 'role' and 'content'")
        unknown = sorted(set(message) - set(MESSAGE_KEYS))
        if unknown:
            raise ValueError(f"{where}: message {turn} has unknown keys {unknown} (known: {list(MESSAGE_KEYS)})")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: message {turn} has role {message['role']!r}; roles are {list(ROLES)}")
        if not isinstance(message["content"], str):
            raise ValueError(f"{where}: message {turn}'s content is {type(message['content']).__name__}, expected "
                             "a string")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn: no token of it would be a loss target")
    return messages


def _marked_tokens(hf, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(token ids, 1 per assistant token) of the conversation, from the template's ``{% generation %}`` markers."""
    out = _apply(hf, where, messages, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [int(bit) for bit in out["assistant_masks"]]


def _prefix_tokens(hf, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(token ids, 1 per assistant token) of the conversation, the assistant's text found by rendering prefixes
    (module docstring)."""
    text = _apply(hf, where, messages, tokenize=False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _apply(hf, where, messages[:turn], tokenize=False, add_generation_prompt=True)
        through = _apply(hf, where, messages[:turn + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(f"{where}: the chat template does not render the conversation's first {turn + 1} "
                             "messages as a prefix of the whole, so its assistant tokens cannot be found from "
                             "prefixes; use a template with {% generation %} markers")
        spans.append((len(before), len(through)))
    encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assistant = [int(any(begin < span_end and span_begin < end for span_begin, span_end in spans))
                 for begin, end in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), assistant


def _apply(hf, where: str, messages: list[dict], **options):
    """``hf.apply_chat_template(messages, **options)``, a template error named by ``where``."""
    try:
        return hf.apply_chat_template(messages, **options)
    except Exception as exc:                       # jinja2's errors (TemplateError, UndefinedError, ...) and raise_exception
        raise ValueError(f"{where}: the chat template fails on this conversation ({type(exc).__name__}: {exc})") \
            from exc
