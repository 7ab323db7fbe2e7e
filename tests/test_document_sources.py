"""The document sources of ``cache/sources/``: each input kind's documents and loss targets (conversations against
transformers' own assistant mask), the indexed dataset's document index, and every refusal, in one line naming the
file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.chat_tokenizers import MARKED_TEMPLATE, PLAIN_TEMPLATE, REWRITING_TEMPLATE, save_tokenizer, save_tokenizer_json
from megatron_kd_plugin.cache.sources import DocumentMasks, input_kind_of, open_documents, resolve_input_kind
from megatron_kd_plugin.cache.sources.source_files import load_tokenizer

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "more?"},
     {"role": "assistant", "content": "yes, more."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{"marked", "plain", "rewriting", "none": transformers tokenizer folders; "json": a bare tokenizer.json}."""
    folder = tmp_path_factory.mktemp("chat_tokenizers")
    found = {name: save_tokenizer(folder / name, template) for name, template in
             (("marked", MARKED_TEMPLATE), ("plain", PLAIN_TEMPLATE), ("rewriting", REWRITING_TEMPLATE),
              ("none", None))}
    found["json"] = save_tokenizer_json(folder / "tokenizer.json")
    return found


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def document(documents, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets) of document ``d`` whole."""
    return documents.pieces(np.array([d]), np.array([0]), documents.lengths[[d]])


def test_assistant_targets_equal_transformers_mask_and_prefix_rendering_finds_the_same(tokenizers, tmp_path):
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages} for messages in CONVERSATIONS])
    marked = AutoTokenizer.from_pretrained(tokenizers["marked"])
    by_markers = open_documents(data, load_tokenizer(tokenizers["marked"]), input_kind="messages")
    by_prefixes = open_documents(data, load_tokenizer(tokenizers["plain"]), input_kind="messages")
    eod = marked.eos_token_id
    for d, messages in enumerate(CONVERSATIONS):
        reference = marked.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        tokens, targets = document(by_markers, d)
        assert tokens.tolist() == reference["input_ids"] + [eod]
        assert targets.tolist() == reference["assistant_masks"] + [0]          # the end-of-document id: no target
        plain_tokens, plain_targets = document(by_prefixes, d)
        assert plain_tokens.tolist() == tokens.tolist() and plain_targets.tolist() == targets.tolist()
        assistant = "".join(marked.convert_ids_to_tokens(tokens[targets == 1].tolist()))
        assert assistant == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert by_markers.lines.tolist() == [1, 2]


def test_prompt_loss_makes_every_conversation_token_a_target(tokenizers, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    masks = DocumentMasks(prompt_loss=True, eod_loss=False)
    tokens, targets = document(open_documents(data, load_tokenizer(tokenizers["plain"]), input_kind="messages",
                                              masks=masks), 0)
    assert targets.tolist() == [1] * (len(tokens) - 1) + [0]


def test_text_documents_end_with_eod_whose_target_eod_loss_sets(tokenizers, tmp_path):
    tokenizer = load_tokenizer(tokenizers["json"])
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "ab c"}, {"text": "d", "id": 7}])
    for eod_loss in (True, False):
        documents = open_documents(data, tokenizer, input_kind="text", masks=DocumentMasks(eod_loss=eod_loss))
        tokens, targets = document(documents, 0)
        assert tokens.tolist() == tokenizer.encode("ab c") + [tokenizer.eod_id]
        assert targets.tolist() == [1, 1, 1, 1, int(eod_loss)]
        assert documents.lengths.tolist() == [5, 2] and documents.where(1) == f"{data}:2"


def test_prompt_response_targets_are_the_response_and_eod(tokenizers, tmp_path):
    tokenizer = load_tokenizer(tokenizers["json"])
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q: ", "response": "yes"}])
    tokens, targets = document(open_documents(data, tokenizer, input_kind="prompt_response"), 0)
    assert tokens.tolist() == tokenizer.encode("q: ") + tokenizer.encode("yes") + [tokenizer.eod_id]
    assert targets.tolist() == [0, 0, 0, 1, 1, 1, 1]
    _, targets = document(open_documents(data, tokenizer, input_kind="prompt_response",
                                         masks=DocumentMasks(prompt_loss=True, eod_loss=False)), 0)
    assert targets.tolist() == [1, 1, 1, 1, 1, 1, 0]


def write_indexed(prefix: str, documents: list[list[list[int]]]) -> str:
    """An indexed dataset whose document i is the sequences ``documents[i]``."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for sequences in documents:
        builder.add_document(torch.tensor([t for sequence in sequences for t in sequence]),
                             [len(sequence) for sequence in sequences])
    builder.finalize(prefix + ".idx")
    return prefix


def test_indexed_documents_follow_the_document_index_and_end_with_eod(tokenizers, tmp_path):
    tokenizer = load_tokenizer(tokenizers["json"])
    eod = tokenizer.eod_id
    prefix = write_indexed(str(tmp_path / "data"), [[[5, 6], [7]], [[8, 9, eod]], [[10]]])
    documents = open_documents(prefix, tokenizer, input_kind=resolve_input_kind(prefix))
    assert documents.kind == "indexed" and documents.lengths.tolist() == [4, 3, 2]
    assert [document(documents, d)[0].tolist() for d in range(3)] == [[5, 6, 7, eod], [8, 9, eod], [10, eod]]
    pieces = documents.pieces(np.array([0, 2]), np.array([2, 0]), np.array([2, 2]))
    assert pieces[0].tolist() == [7, eod, 10, eod] and pieces[1].tolist() == [1, 1, 1, 1]
    assert documents.where(2) == f"{prefix}.bin document 2"


def test_input_kind_found_from_the_first_record(tmp_path):
    cases = {"text": {"text": "a"}, "messages": {"messages": []}, "prompt_response": {"prompt": "a", "response": "b"}}
    for kind, record in cases.items():
        assert input_kind_of(write_jsonl(tmp_path / f"{kind}.jsonl", [record])) == kind
    assert input_kind_of(str(tmp_path / "prefix")) == "indexed"
    both = write_jsonl(tmp_path / "both.jsonl", [{"text": "a", "messages": []}])
    with pytest.raises(ValueError, match=r"both.jsonl:1: the keys \['messages', 'text'\] fit several"):
        input_kind_of(both)
    with pytest.raises(ValueError, match=r"other.jsonl:1: the keys \['body'\] fit none"):
        input_kind_of(write_jsonl(tmp_path / "other.jsonl", [{"body": "a"}]))
    with pytest.raises(ValueError, match="input kind 'indexed': .*both.jsonl is a JSONL file"):
        resolve_input_kind(both, "indexed")
    with pytest.raises(ValueError, match="input kind 'chat'; choose one of"):
        resolve_input_kind(both, "chat")


BAD_CONVERSATIONS = {
    "no assistant": ([{"role": "user", "content": "hi"}], ":1: the conversation has no assistant turn"),
    "unknown role": ([{"role": "robot", "content": "hi"}], ":1: message 0 has role 'robot'; roles are"),
    "unknown key": ([{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "a"}],
                    r":1: message 0 has unknown keys \['weight'\]"),
    "content": ([{"role": "assistant", "content": ["a"]}], ":1: message 0's content is list, expected a string"),
    "no role": ([{"content": "a"}], ":1: message 0 is not an object with 'role' and 'content'"),
    "empty": ([], ":1: not a JSON object with a non-empty 'messages' list"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONVERSATIONS))
def test_bad_conversations_refused_naming_file_and_line(tokenizers, tmp_path, case):
    messages, message = BAD_CONVERSATIONS[case]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    with pytest.raises(ValueError, match=f"chat.jsonl{message}"):
        open_documents(data, load_tokenizer(tokenizers["plain"]), input_kind="messages")


def test_conversations_refused_without_a_chat_template_or_with_one_that_rewrites_turns(tokenizers, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[0]}])
    for name in ("none", "json"):
        with pytest.raises(ValueError, match="has no chat template: conversations"):
            open_documents(data, load_tokenizer(tokenizers[name]), input_kind="messages")
    with pytest.raises(ValueError, match="chat.jsonl:2: the chat template does not render the conversation's first 3 "
                                         "messages as a prefix"):
        open_documents(data, load_tokenizer(tokenizers["rewriting"]), input_kind="messages")


def test_bad_records_and_empty_inputs_refused_in_one_line(tokenizers, tmp_path):
    tokenizer = load_tokenizer(tokenizers["json"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for kind in ("text", "prompt_response"):
        with pytest.raises(ValueError, match="empty.jsonl holds no"):
            open_documents(str(empty), tokenizer, input_kind=kind)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": ""}])
    with pytest.raises(ValueError, match="pairs.jsonl:2: the response is empty"):
        open_documents(pairs, tokenizer, input_kind="prompt_response")
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: not a JSON object with a 'text' string \(it has"):
        open_documents(pairs, tokenizer, input_kind="text")
    with pytest.raises(ValueError, match="prompt_loss applies to conversations and prompt/response pairs"):
        open_documents(pairs, tokenizer, input_kind="text", masks=DocumentMasks(prompt_loss=True))
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(ValueError, match="eod_loss=0 changes nothing for conversations"):
        open_documents(chat, load_tokenizer(tokenizers["plain"]), input_kind="messages",
                       masks=DocumentMasks(eod_loss=False))
