"""Tiny transformers tokenizers with chat templates, built in the test (nothing downloaded): one token per
character (every character of a rendering lies in a token, so assistant masks found from characters and from
transformers' markers can agree), ChatML-like turns, ``<|endoftext|>`` the end-of-document id."""

from __future__ import annotations

import pathlib

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:?!'\"-\n"
_TURN = "{{ '<|im_start|>' + m['role'] + '\\n' }}"
_BODY = "{{ m['content'] + '<|im_end|>' + '\\n' }}"
_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
MARKED_TEMPLATE = ("{% for m in messages %}" + _TURN + "{% if m['role'] == 'assistant' %}{% generation %}" + _BODY
                   + "{% endgeneration %}{% else %}" + _BODY + "{% endif %}{% endfor %}" + _PROMPT)
"""Assistant turns inside ``{% generation %}`` markers (their content and end-of-turn markup)."""
PLAIN_TEMPLATE = "{% for m in messages %}" + _TURN + _BODY + "{% endfor %}" + _PROMPT
"""The same rendering without markers."""
REWRITING_TEMPLATE = ("{% for m in messages %}" + _TURN + "{% if m['role'] == 'assistant' and not loop.last %}"
                      "{{ 'ok<|im_end|>\\n' }}{% else %}" + _BODY + "{% endif %}{% endfor %}" + _PROMPT)
"""Earlier assistant turns rendered shortened (as templates that drop earlier reasoning do): prefixes of a
conversation are not prefixes of its rendering."""


def backend(characters: str = CHARACTERS):
    """A ``tokenizers.Tokenizer``: one token per character of ``characters``, the specials whole (ids
    0..3 + len(characters))."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{token: i + 1 for i, token in enumerate(SPECIALS)}}
    vocab.update({c: len(vocab) + i for i, c in enumerate(characters)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def save_tokenizer(folder: pathlib.Path, template: str | None) -> str:
    """A transformers tokenizer folder with ``template`` (None: no chat template); returns its path."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend(), eos_token="<|endoftext|>", unk_token="[UNK]")
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def save_tokenizer_json(path: pathlib.Path, characters: str = CHARACTERS) -> str:
    """The bare tokenizer.json of :func:`backend` (no chat template); returns its path."""
    backend(characters).save(str(path))
    return str(path)
