"""Hugging Face teachers through Megatron-Bridge in the cache tool, against transformers' own float64 forward.

One spawn of two gloo ranks does all the megatron work (each spawn costs seconds of imports):
- full logits of a dense Qwen3 at TP=2 (vocabulary padded 1000 -> 1008, the pad masked) and of a Qwen3-MoE at
  EP=2, through the tool's ``TeacherForward``, against ``transformers``' forward;
- the tool (``commands.cache.run``, the command's body) writing a store per layout: dense TP=1 (DP=2), TP=2, PP=2,
  PP=2 over 3 layers (uneven stages);
  MoE TP=1 (DP=2) and EP=2 (DP=2, uneven shards, so one EP rank runs dummy forwards); a teacher with a
  vocabulary of 140,001 (> 2^17, the limit of Megatron-LM's packed ids) at TP=2;
- the tool's refusals of bad input, each one line, before any model is built.
The parent compares every store with the float64 top-K of ``transformers`` and with the TP=1 store.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from tests.distributed import run_on_ranks
from tests.hf_models import hf_logits, save_tiny_causal_lm, save_word_tokenizer

S, K, NUM_SAMPLES = 16, 8, 9
BIG_VOCAB = 140_001            # > 2^17 = 131,072; odd, so TP=2 pads one row
COMMON = ["--seq-length", str(S), "--topk", str(K), "--num-samples", str(NUM_SAMPLES), "--samples-per-shard", "2",
          "--micro-batch-size", "2", "--logprob-codec", "fp32", "--no-progress"]
LAYOUTS = {          # store name: (teacher, data, extra flags); world = 2 ranks
    "dense_tp1": ("dense", "small", []),
    "dense_tp2": ("dense", "small", ["--tp", "2"]),
    "dense_pp2": ("dense", "small", ["--pp", "2"]),
    "dense3_pp2": ("dense3", "small", ["--pp", "2"]),         # 3 layers: uneven stages of 2 + 1
    "moe_tp1": ("moe", "small", []),
    "moe_ep2": ("moe", "small", ["--ep", "2"]),
    "big_tp2": ("big", "big", ["--tp", "2"]),
}
BAD = {              # name: (teacher, extra flags, expected fragment of the one-line error)
    "no weights": ("no_weights", [], "no *.safetensors weights"),
    "unconverted architecture": ("gptj", [], "architecture GPTJForCausalLM is not one Megatron-Bridge"),
    "tp vs heads": ("dense", ["--tp", "4"], "tensor_parallel=4 does not divide the 2 key/value heads"),
    "ep vs experts": ("moe", ["--ep", "3"], "expert_parallel=3 does not divide the model's 4 experts"),
    "pp vs layers": ("dense", ["--pp", "4"], "pipeline_parallel=4 exceeds the model's 2 layers"),
    "world vs tp x pp": ("dense", ["--tp", "2", "--pp", "2"], "world size 2 is not a multiple of --tp x --pp"),
    "world vs ep": ("moe", ["--pp", "2", "--ep", "2"], "world size 2 is not a multiple of --etp x --ep x --pp"),
    "tokenizer vocab": ("dense", ["--tokenizer", "{big_tokenizer}"], "has 1200 ids but the teacher's vocabulary"),
}


def _jsonl(path: pathlib.Path, low: int, high: int, seed: int) -> str:
    """Documents of random words of the test tokenizer (ids low..high-1): the tool tokenizes them itself."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for length in rng.integers(5, 30, 12):
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in rng.integers(low, high, length))}) + "\n")
    return str(path)


def _megatron_logits(teachers: dict, tokens: torch.Tensor) -> dict:
    """Full logits ``[s, b, V_pad/tp]`` of this rank: dense at TP=2, MoE at EP=2 (every rank the same tokens)."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.models.hf import build_model, hf_model_provider, padded_vocab_size
    from megatron_kd_plugin.commands.cache import init_distributed
    from megatron_kd_plugin.cache.teacher_forward import TeacherForward

    out = {}
    for name, sizes in (("dense", dict(tensor_parallel=2)), ("moe", dict(expert_parallel=2))):
        provider = hf_model_provider(teachers[name], inference=True, **sizes)
        init_distributed(provider.tensor_model_parallel_size, 1, provider.expert_model_parallel_size,
                         provider.expert_tensor_parallel_size)
        chunks = build_model(provider)
        chunks[0].eval()
        forward = TeacherForward(chunks, vocab_size=provider.vocab_size,
                                 tp_rank=parallel_state.get_tensor_model_parallel_rank())
        head = forward(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))  # hidden states + lm_head shard
        out[name] = head.logits(slice(None), slice(None))                       # today's logits, formed whole
        out[f"{name} kinds"] = _kinds_blockwise_vs_whole(head, out[name], parallel_state)
        out[f"{name} padded vocab"] = padded_vocab_size(provider)
        parallel_state.destroy_model_parallel()
    return out


def _kinds_blockwise_vs_whole(head, logits: torch.Tensor, parallel_state) -> dict:
    """{kind: (ids identical, largest |difference| of the float rows)}: every store kind's rows from the fused head in
    blocks of 3 token rows against the same kind on the whole logits ``[s, b, V/tp]`` (tests/test_teacher_head.py's
    kinds), on this rank's TP group."""
    from megatron_kd_plugin.cache.store.array_names import IDS
    from megatron_kd_plugin.cache.store.format import CacheSpec
    from megatron_kd_plugin.cache.writer import teacher_rows
    from tests.test_teacher_head import SPECS

    group = parallel_state.get_tensor_model_parallel_group()
    labels = torch.randint(0, 1000, logits.shape[:2], generator=torch.Generator().manual_seed(1))
    out = {}
    for kind, fields in SPECS.items():
        spec = CacheSpec(vocab_size=head.vocab_size, seq_length=S, num_samples=2, **fields)
        whole, _ = teacher_rows(logits, spec, first_sample=0, tp_group=group, labels=labels)
        row = (head.logit_bytes + spec.kind.work_bytes_per_logit) * head.vocab_local
        fused, _ = teacher_rows(head, spec, first_sample=0, tp_group=group, labels=labels, chunk_bytes=3 * row)
        out[kind] = (torch.equal(fused[IDS], whole[IDS]),
                     max(float((fused[name] - whole[name]).abs().max()) for name in fused if name != IDS))
    return out


def _all_on_two_ranks(teachers: dict, data: dict, work: str, tokens: torch.Tensor):
    """(megatron logits, {bad input: error message}) on this rank; writes every store of LAYOUTS."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.commands.cache import parse_args, run

    parallel_state.destroy_model_parallel()            # run_on_ranks' TP=1 state: each layout makes its own
    logits = _megatron_logits(teachers, tokens)
    for name, (teacher, source, flags) in LAYOUTS.items():
        run(parse_args(["--teacher", teachers[teacher], "--data", data[source], "--output", f"{work}/{name}.zarr",
                        *COMMON, *flags]))
    errors = {}
    for name, (teacher, flags, _) in BAD.items():
        flags = [flag.format(**teachers) for flag in flags]
        try:
            run(parse_args(["--teacher", teachers[teacher], "--data", data["small"], "--output",
                            f"{work}/bad.zarr", *COMMON, *flags]))
        except ValueError as exc:
            errors[name] = str(exc)
    return logits, errors


@pytest.fixture(scope="module")
def stores(tiny_hf_qwen3, tiny_hf_qwen3_moe, tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_teacher")
    dense3 = save_tiny_causal_lm(work / "dense3", "qwen3", num_hidden_layers=3, seed=2)
    big = save_tiny_causal_lm(work / "big", "qwen3", vocab_size=BIG_VOCAB, hidden_size=32, intermediate_size=64)
    no_weights = work / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_hf_qwen3 / "config.json").read_text())
    gptj = work / "gptj"
    gptj.mkdir()
    (gptj / "config.json").write_text(json.dumps({"architectures": ["GPTJForCausalLM"], "model_type": "gptj",
                                                  "n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 100}))
    (gptj / "model.safetensors").write_bytes(b"")
    save_word_tokenizer(work / "big_tokenizer", 1200)
    teachers = dict(dense=str(tiny_hf_qwen3), moe=str(tiny_hf_qwen3_moe), dense3=str(dense3), big=str(big),
                    no_weights=str(no_weights), gptj=str(gptj),
                    big_tokenizer=str(work / "big_tokenizer" / "tokenizer.json"))
    data = dict(small=_jsonl(work / "small.jsonl", 2, 1000, 0),
                big=_jsonl(work / "big.jsonl", 1 << 17, BIG_VOCAB, 1))   # ids above 2^17
    tokens = torch.randint(0, 1000, (2, S), generator=torch.Generator().manual_seed(0))
    results = run_on_ranks(2, _all_on_two_ranks, teachers, data, str(work), tokens, tp=1, timeout=600)
    logits = {name: [rank_logits[name] for rank_logits, _ in results] for name in results[0][0]}
    return work, teachers, tokens, logits, results[0][1]


def test_megatron_teacher_logits_equal_transformers_dense_tp2_and_moe_ep2(stores):
    _, teachers, tokens, logits, _ = stores
    dense = torch.cat(logits["dense"], dim=-1)                      # TP=2: the two vocab shards [s, b, 504] each
    assert dense.shape[-1] == logits["dense padded vocab"][0] == 1008 and logits["moe padded vocab"][0] == 1000
    assert bool((dense[..., 1000:] == float("-inf")).all())                                # padded rows masked
    for name, got in (("dense", dense[..., :1000]), ("moe", logits["moe"][0]), ("moe", logits["moe"][1])):
        ref = hf_logits(teachers[name], tokens).transpose(0, 1)                       # [s, b, V] float64
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=0)


def test_every_kind_from_the_fused_head_equals_the_whole_logits_dense_tp2_and_moe_ep2(stores):
    *_, logits, _ = stores
    for name in ("dense kinds", "moe kinds"):
        for rank, kinds in enumerate(logits[name]):
            for kind, (same_ids, largest) in kinds.items():
                assert same_ids and largest < 2e-6, (name, rank, kind, largest)


def _reference_topk(folder, tokens: torch.Tensor):
    """float64 log-probs ``[n, S, V]`` of transformers and the top-K ids where the K-th/(K+1)-th gap is clear."""
    logprobs = torch.log_softmax(hf_logits(folder, tokens), dim=-1)
    top = torch.topk(logprobs, K + 1, dim=-1)
    clear = (top.values[..., K - 1] - top.values[..., K]) > 1e-5                    # [n, S]
    return logprobs, top.indices[..., :K].sort(dim=-1).values, clear


@pytest.mark.parametrize("teacher,names", [("dense", ["dense_tp1", "dense_tp2", "dense_pp2"]),
                                           ("dense3", ["dense3_pp2"]), ("moe", ["moe_tp1", "moe_ep2"]),
                                           ("big", ["big_tp2"])])
def test_stores_at_every_layout_hold_transformers_topk_and_the_true_vocab(stores, teacher, names):
    from megatron_kd_plugin.cache import TopKCacheReader

    work, teachers, *_ = stores
    readers = {name: TopKCacheReader(work / f"{name}.zarr") for name in names}
    first = readers[names[0]]
    tokens = torch.stack([first[i].tokens[:-1] for i in range(NUM_SAMPLES)]).long()    # [n, S]
    logprobs, ids, clear = _reference_topk(teachers[teacher], tokens)
    vocab = BIG_VOCAB if teacher == "big" else 1000
    if teacher == "big":
        assert int(tokens.max()) >= 1 << 17                     # ids above Megatron-LM's 17-bit packing
    assert clear.float().mean() > 0.9
    for name, reader in readers.items():
        assert reader.spec.vocab_size == vocab, name            # the true vocab, not the padded 1008 / 140,002
        arch = "Qwen3MoeForCausalLM" if teacher == "moe" else "Qwen3ForCausalLM"
        assert reader.spec.teacher.startswith(f"{arch}:") and reader.spec.tokenizer == teachers[teacher]
        for i in range(NUM_SAMPLES):
            row = reader[i]
            assert torch.equal(row.tokens[:-1].long(), tokens[i])
            got = row.teacher.ids.long()                                                # [S, K]
            assert int(got.max()) < vocab, name                 # no padded row ever enters the top-K
            assert torch.equal(got[clear[i]], ids[i][clear[i]]), (name, i)     # transformers' float64 top-K
            assert torch.equal(got[clear[i]], first[i].teacher.ids[clear[i]].long()), (name, i)  # = TP=1 store
            torch.testing.assert_close(row.teacher.logprobs.double(), logprobs[i].gather(-1, got),
                                       atol=2e-6, rtol=0)       # fp32 codec: the LSE holds no padded row


def test_bad_input_gets_one_line_naming_the_value_before_any_forward(stores):
    *_, errors = stores
    for name, (_, _, fragment) in BAD.items():
        assert name in errors, f"{name}: not refused"
        assert fragment in errors[name] and "\n" not in errors[name], (name, errors[name])
