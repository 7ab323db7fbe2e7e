"""``demo --chat``'s conversations, made from the demo's own corpus, and the chat template that renders them.

Each document (a stdlib file, or a ``--corpus`` document) of a split gives several two-turn conversations, in order
through the text, all its text used once (``file_conversations``):

    user:       an instruction naming the file ("Continue json/decoder.py:") and a stretch of its text
    assistant:  the text that follows that stretch

The stretches are whole lines (a line longer than the shortest stretch is cut into pieces first), each a random
length in ``prompt_chars`` / ``answer_chars`` characters, drawn from ``random.Random(f"{seed}:{name}")``: the same
seed and documents give the same conversations on every machine. Documents keep their split (a held-out file's
conversations are held out), so what the bootstrap resamples are the held-out files. There is no system turn.

``fit_conversation`` then shortens a conversation until its rendering (``CHAT_TEMPLATE``, the end-of-document id
appended as the cache appends it) fits one row of S + 1 tokens, so that the packed cache never splits one and each
is attended alone, whole, in the cache, the heals and the evaluation: the answer is cut at its end, the prompt at its
start (the lines next to the answer stay), a fifth of the longer one at a time; one whose answer or prompt runs out
is dropped.

The template is ChatML (``<|im_start|>role\\n ... <|im_end|>\\n``; the two markers are special tokens added to the
demo's tokenizer) with ``{% generation %}`` markers around the assistant's content and its ``<|im_end|>``: the
assistant mask comes from transformers' own ``return_assistant_tokens_mask``, the way the cache's conversation
source reads it (``cache/sources/conversation_documents.py``).
"""

from __future__ import annotations

import pathlib
import random
from collections.abc import Callable

CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")
"""The special tokens the template's turns are marked with (added to the demo's tokenizer)."""
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
                 "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
                 "{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""ChatML with the assistant's content and end-of-turn marker inside ``{% generation %}``."""
INSTRUCTIONS = ("Continue {name}:", "What comes next in {name}?", "Write the next lines of {name}.",
                "Go on with this part of {name}:")
"""The user turn's first line, one drawn per conversation (``{name}``: the document's last two path parts)."""


def _stretch(pieces: list[str], start: int, chars: int) -> tuple[str, int]:
    """Whole pieces from ``start`` up to ``chars`` characters (at least one); the text and the next index."""
    end, used = start, 0
    while end < len(pieces) and (end == start or used + len(pieces[end]) <= chars):
        used += len(pieces[end])
        end += 1
    return "".join(pieces[start:end]), end


def file_conversations(text: str, name: str, *, seed: int, prompt_chars: tuple[int, int],
                       answer_chars: tuple[int, int]) -> list[list[dict]]:
    """The conversations (lists of messages) of one document named ``name`` (module docstring)."""
    rng = random.Random(f"{seed}:{name}")
    limit = min(prompt_chars[0], answer_chars[0])
    pieces = [line[k:k + limit] for line in text.splitlines(keepends=True) for k in range(0, len(line), limit)]
    shown = "/".join(pathlib.PurePath(name).parts[-2:])
    conversations, index = [], 0
    while index < len(pieces):
        prompt, index = _stretch(pieces, index, rng.randint(*prompt_chars))
        answer, index = _stretch(pieces, index, rng.randint(*answer_chars))
        instruction = rng.choice(INSTRUCTIONS).format(name=shown)
        if prompt.strip() and answer.strip():
            conversations.append([{"role": "user", "content": f"{instruction}\n{prompt}"},
                                  {"role": "assistant", "content": answer}])
    return conversations


def fit_conversation(messages: list[dict], ids: Callable[[list[dict]], list[int]],
                     max_tokens: int) -> tuple[list[dict], list[int]] | None:
    """``messages`` shortened until ``len(ids(messages)) <= max_tokens`` (module docstring), with its ids; None when
    the answer or the prompt runs out first. ``ids``: the rendering's tokens, the end-of-document id last."""
    (instruction, prompt), answer = messages[0]["content"].split("\n", 1), messages[1]["content"]
    while True:
        if not prompt.strip() or not answer.strip():
            return None
        fitted = [{"role": "user", "content": f"{instruction}\n{prompt}"}, {"role": "assistant", "content": answer}]
        fitted_ids = ids(fitted)
        if len(fitted_ids) <= max_tokens:
            return fitted, fitted_ids
        if len(answer) >= len(prompt):
            answer = answer[:len(answer) * 4 // 5]
        else:
            prompt = prompt[-(len(prompt) * 4 // 5):] if len(prompt) >= 5 else ""


def rendered_ids(tokenizer) -> Callable[[list[dict]], list[int]]:
    """messages -> the token ids ``cache --input-kind messages`` gives them: ``tokenizer``'s (a transformers
    tokenizer with ``CHAT_TEMPLATE``) rendering, tokenized without special tokens added, then its end-of-text id."""
    def ids(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    return ids


def split_conversations(texts: list[str], names: list[str], tokenizer, *, seed: int, prompt_chars: tuple[int, int],
                        answer_chars: tuple[int, int], max_tokens: int) -> tuple[list[list[dict]], list[int],
                                                                                 list[list[int]], int]:
    """Every fitted conversation of one split's documents, in document order: (conversations, the document index of
    each, the token ids of each (``rendered_ids``), conversations dropped by ``fit_conversation``)."""
    ids = rendered_ids(tokenizer)
    conversations, documents, tokens, dropped = [], [], [], 0
    for index, (text, name) in enumerate(zip(texts, names, strict=True)):
        for messages in file_conversations(text, name, seed=seed, prompt_chars=prompt_chars,
                                           answer_chars=answer_chars):
            fitted = fit_conversation(messages, ids, max_tokens)
            if fitted is None:
                dropped += 1
                continue
            conversations.append(fitted[0])
            documents.append(index)
            tokens.append(fitted[1])
    return conversations, documents, tokens, dropped
