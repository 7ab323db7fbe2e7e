"""``demo --chat``: the conversations it builds from a corpus, its assistant-only evaluation against transformers'
own forward of each conversation alone (masked by ``apply_chat_template(..., return_assistant_tokens_mask=True)``),
its refusals, and the miniature run end to end."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_kd_plugin.demo import conversations as chat_data
from tests.chat_tokenizers import save_tokenizer
from tests.distributed import scaled

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = "".join(f"line {i} of the file: value {i * i}\n" for i in range(60)) + ("x" * 95) + "\nlast line\n"
"""Lines the tests' character tokenizer spells (``tests.chat_tokenizers.CHARACTERS``), one longer than a stretch."""


def test_conversations_cover_each_file_in_order_and_follow_the_seed():
    options = dict(prompt_chars=(40, 90), answer_chars=(30, 70))
    first = chat_data.file_conversations(TEXT, "pkg/sub/mod.py", seed=3, **options)
    assert first == chat_data.file_conversations(TEXT, "pkg/sub/mod.py", seed=3, **options)
    assert first != chat_data.file_conversations(TEXT, "pkg/sub/mod.py", seed=4, **options)
    assert len(first) > 5
    stretches = []
    for user, assistant in first:
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        instruction, prompt = user["content"].split("\n", 1)
        assert "sub/mod.py" in instruction and instruction in {i.format(name="sub/mod.py")
                                                               for i in chat_data.INSTRUCTIONS}
        assert len(prompt) <= 90 and len(assistant["content"]) <= 70        # the 95-character line is cut at 30
        stretches += [prompt, assistant["content"]]
    covered = "".join(stretches)                   # every character once, in order; a last prompt without answer
    assert TEXT.startswith(covered) and len(TEXT) - len(covered) <= 90      # is no conversation


def test_fitted_conversations_fit_a_row_and_render_as_the_cache_renders_them(tmp_path):
    from transformers import AutoTokenizer

    from megatron_kd_plugin.cache.sources.conversation_documents import conversation_documents
    from megatron_kd_plugin.cache.sources.source_files import load_tokenizer

    folder = save_tokenizer(tmp_path / "tok", chat_data.CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [TEXT, "tiny\n", "a" * 10 + "\n" + "b" * 200 + "\n"]
    conversations, files, tokens, dropped = chat_data.split_conversations(
        texts, ["a.py", "b.py", "c.py"], tokenizer, seed=0, prompt_chars=(40, 90), answer_chars=(30, 70),
        max_tokens=96)
    assert set(files) == {0, 2} and files == sorted(files) and dropped == 0  # "tiny" makes no conversation
    assert all(len(ids) <= 96 for ids in tokens) and max(map(len, tokens)) > 70
    long = chat_data.file_conversations(TEXT, "a.py", seed=0, prompt_chars=(40, 90), answer_chars=(30, 70))
    assert len([f for f in files if f == 0]) == len(long)                  # a.py's all fit, shortened where needed
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    documents = conversation_documents(str(path), load_tokenizer(folder))
    assert documents.tokens.tolist() == [t for ids in tokens for t in ids]
    assert 0 < documents.targets.sum() < len(documents.targets)


def _tiny_qwen3(vocab_size: int, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config).eval()


def test_assistant_only_evaluation_equals_each_conversation_alone_in_float64(tmp_path):
    """The demo's held-out conversations (the cache's conversation source) scored in right-padded batches equal
    transformers' float64 forward of each conversation alone over the tokens ``apply_chat_template`` marks as the
    assistant's, summed per file; the prompt's tokens count nowhere."""
    from transformers import AutoTokenizer

    from megatron_kd_plugin.demo.chat import ChatConfig, heldout_conversations
    from megatron_kd_plugin.demo.metrics import evaluate_masked_documents

    folder = tmp_path / "chat"
    save_tokenizer(folder / "tokenizer", chat_data.CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    texts = [TEXT, TEXT.upper(), "first: 1\nsecond: 2\nthird: 3\nfourth: 4\n" * 20]
    conversations, files, _, _ = chat_data.split_conversations(texts, ["a", "b", "c"], tokenizer, seed=1,
                                                               prompt_chars=(20, 60), answer_chars=(10, 50),
                                                               max_tokens=129)
    (folder / "heldout.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    (folder / "heldout_files.json").write_text(json.dumps(files))
    heldout = heldout_conversations(ChatConfig(eval_conversations=7), folder)
    chosen = [i * len(files) // 7 for i in range(7)]
    assert heldout.files == [files[i] for i in chosen] and len(set(heldout.files)) == 3
    teacher, student = _tiny_qwen3(len(tokenizer), 0), _tiny_qwen3(len(tokenizer), 1)
    got = evaluate_masked_documents({"student": student}, teacher, heldout.tokens, heldout.targets, heldout.files,
                                    pad_id=tokenizer.eos_token_id, micro_batch_size=3)

    nll, kl, count = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), torch.zeros(3)
    teacher64, student64 = _tiny_qwen3(len(tokenizer), 0).double(), _tiny_qwen3(len(tokenizer), 1).double()
    for index in chosen:
        out = tokenizer.apply_chat_template(conversations[index], return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = torch.tensor(out["input_ids"] + [tokenizer.eos_token_id])           # the cache appends the EOD
        mask = torch.tensor(out["assistant_masks"] + [0], dtype=torch.bool)
        assert mask.any() and not mask.all()
        with torch.no_grad():
            p = torch.log_softmax(teacher64(input_ids=ids[None, :-1]).logits[0], -1)[mask[1:]]
            q = torch.log_softmax(student64(input_ids=ids[None, :-1]).logits[0], -1)[mask[1:]]
        labels = ids[1:][mask[1:]]
        nll[files[index]] += -q.gather(1, labels[:, None]).sum()
        kl[files[index]] += (p.exp() * (p - q)).sum()
        count[files[index]] += len(labels)
    by_file = got["student"]["by_document"]
    assert by_file["tokens"] == count.tolist()
    torch.testing.assert_close(torch.tensor(by_file["nll"], dtype=torch.float64), nll, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.tensor(by_file["kl"], dtype=torch.float64), kl, rtol=1e-4, atol=1e-5)
    assert got["student"]["perplexity"] == pytest.approx(float(torch.exp(nll.sum() / count.sum())), rel=1e-5)
    assert got["teacher"]["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6) and got["student"]["tokens"] == count.sum()


@pytest.mark.parametrize("argv, says", [
    (["--chat", "--layout", "stream"], "packed rows"),
    (["--chat", "--mixture"], "--chat and --mixture name different demos"),
    (["--chat", "--from-scratch"], "--chat and --from-scratch name different demos"),
    (["--student-tokenizer", "bpe", "--chat"], "name different demos"),
])
def test_chat_refuses_what_it_cannot_combine_in_one_line(tmp_path, capsys, argv, says):
    from megatron_kd_plugin.demo.command import main

    out = tmp_path / "out"
    assert main([*argv, "--preset", "mini", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("demo: error:") and len(err.splitlines()) == 1
    assert not out.exists()


def test_mini_chat_demo_end_to_end(tmp_path):
    """The whole mini chat demo in a fresh process: a packed assistant-only store, KD and a CE sweep healed from
    it, every model scored on held-out assistant tokens with the bootstrap's verdict."""
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.demo.chat import PRESETS

    mini = PRESETS["mini"]
    folder = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "megatron_kd_plugin", "demo", "--chat", "--preset", "mini",
                           "--output", str(folder)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=scaled(900), env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((folder / "metrics.json").read_text())
    metrics, outcome, rows = result["metrics"], result["outcome"], result["rows"]
    assert set(metrics) == {"teacher", "pruned", "healed KD", "healed CE", "unigram"}
    assert set(result["ce_sweep"]) == {f"{lr:g}" for lr in mini.ce_lrs}
    best = min(result["ce_sweep"].values(), key=lambda m: m["perplexity"])
    assert metrics["healed CE"] == best and result["ce_lr"] in result["ce_sweep"]
    low, high = outcome["kd_vs_ce_perplexity_interval"]
    assert low <= outcome["kd_vs_ce_perplexity"] <= high and outcome["documents_resampled"] >= 2
    assert outcome["verdict"].startswith("KD beats CE" if high < 0 and outcome["kd_minus_ce_kl_interval"][1] < 0
                                         else "KD does NOT beat CE")
    loss_mask = fmt.open_group(folder / "cache.zarr", mode="r")["loss_mask"][:]
    assert loss_mask.shape == (mini.heal.cache_samples, mini.heal.seq_length)
    assert rows["loss_targets"] == loss_mask.sum() and 0.1 < rows["masked_in"] < 0.9   # the assistant's share
    assert rows["layout"] == "packed" and rows["packing"]["split"] == 0        # every conversation fits a row
    evaluated = result["evaluated"]["conversations"]
    assert evaluated == min(mini.eval_conversations, result["conversations"]["heldout"]["conversations"])
    assert metrics["teacher"]["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["healed KD"]["kl_to_teacher"] < metrics["pruned"]["kl_to_teacher"]
    table = (folder / "results.md").read_text()
    assert "held-out assistant perplexity" in table and "masked in" in table and "swept on these rows" in table
    for name in ("chat/train.jsonl", "chat/heldout.jsonl", "chat/tokenizer/tokenizer_config.json",
                 "healed_kd/model.safetensors", "healed_ce/model.safetensors", "results.png"):
        assert (folder / name).exists(), name
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(folder / "teacher")).chat_template == chat_data.CHAT_TEMPLATE
    commands = (folder / "commands.sh").read_text()
    assert "--input-kind messages" in commands and "--layout packed" in commands
    assert commands.count(" train ") == 1 + len(mini.ce_lrs)
