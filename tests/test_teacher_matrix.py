"""Every teacher family the README names, at every layout the docs print, against transformers' own forward.

Tiny random-init checkpoints made by ``transformers`` (``tests/hf_models.py``, 2 layers, hidden 64), each with its
family's peculiarities at non-default values (``perturb=True``: norms, biases, attention sinks, router correction
biases): Llama; gpt-oss (sliding window, attention sinks, YaRN, biased experts and router); GLM-4.5 (``Glm4Moe``:
dense then MoE layer, shared expert, sigmoid router with correction bias, partial rotary, QK norm, q/k/v bias);
DeepSeek-V3, Kimi-K2's architecture (multi-latent attention with YaRN mscale, group-limited sigmoid routing, shared
expert). Qwen3 and Qwen3-MoE are ``tests/test_hf_teacher.py``'s (TP=1, TP=2, PP=2, EP=2); here Qwen3-MoE adds the
layouts that test lacks. gpt-oss also as released: its experts in MXFP4 (``save_mxfp4_copy``), which Bridge
dequantizes on load and transformers (the reference) dequantizes itself.

Each store is written by the unchanged ``cache`` command (its ``main``, in-process on gloo ranks: one spawn per world
size, every layout in it) on a Megatron indexed dataset of random ids, ``--logprob-codec fp32``, and must hold
``transformers``' float64 top-K ids and their log-probs:
- world 2: TP=1 (DP=2), TP=2, PP=2; MoE also EP=2 (DP=2) and TP=2 x EP=2 (expert TP 1, the experts folded over
  the two TP ranks);
- world 4: the docs' gpt-oss-120b command (``--tp 2 --ep 4``, read from docs/caching.md; expert TP 1, which gpt-oss's
  expert biases need) on a gpt-oss of the real vocabulary, 201,088 ids, on data whose ids lie above 2^17; and
  TP=2 x EP=2 at megatron-core's default expert TP (= TP = 2) for the MoE families without expert biases;
- every other store kind (top-p, draws at proposal temperature 1.3, head + draws) at every 2-rank layout of gpt-oss,
  each against the kind's rows of transformers' logits and against its TP=1 store; the fused teacher head
  (``cache/teacher_head.py``) runs in blocks of a few token rows throughout (``--head-chunk-bytes``);
- the refusals of combinations a model cannot take: one ``error:`` line, exit code 2, before the teacher loads.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex

import numpy as np
import pytest
import torch

from tests.distributed import run_on_ranks
from tests.hf_models import hf_logits, save_mxfp4_copy, save_tiny_causal_lm

S, K, NUM_SAMPLES, VOCAB = 16, 16, 4, 512
GPT_OSS_VOCAB = 201_088
COMMON = ["--seq-length", str(S), "--num-samples", str(NUM_SAMPLES), "--samples-per-shard", "1",
          "--micro-batch-size", "2", "--logprob-codec", "fp32", "--no-progress",
          "--head-chunk-bytes", str(5 * 17 * VOCAB)]     # the fused head in blocks of ~5 token rows (V/tp=512 or less)
TOPK = ["--topk", str(K)]
KIND_FLAGS = {       # every other store kind: its flags (top-K is every store's TOPK)
    "top_p": ["--topk", str(K), "--top-p", "0.8", "--min-k", "2"],
    "draws": ["--draws", "12", "--proposal-temperature", "1.3", "--draw-seed", "5"],
    "head_draws": ["--head", "4", "--draws", "12", "--draw-seed", "6"],
}
KIND_FAMILY = "gpt_oss"
"""The family whose every layout also writes every other kind (``KIND_FLAGS``)."""
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "caching.md"

DENSE_LAYOUTS = {"tp1": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
MOE_LAYOUTS = {**DENSE_LAYOUTS, "ep2": ["--ep", "2"], "tp2_ep2": ["--tp", "2", "--ep", "2", "--etp", "1"]}
FAMILIES = {         # family: (architecture, layouts on 2 ranks)
    "llama": ("LlamaForCausalLM", DENSE_LAYOUTS),
    "gpt_oss": ("GptOssForCausalLM", {**MOE_LAYOUTS, "tp2_ep2": ["--tp", "2", "--ep", "2"]}),   # expert TP 1: default
    "glm4_moe": ("Glm4MoeForCausalLM", MOE_LAYOUTS),
    "deepseek_v3": ("DeepseekV3ForCausalLM", MOE_LAYOUTS),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {name: MOE_LAYOUTS[name] for name in ("pp2", "tp2_ep2")}),
    "gpt_oss_mxfp4": ("GptOssForCausalLM", {"tp2_ep2": ["--tp", "2", "--ep", "2"]}),   # experts as released: MXFP4
}
ON_FOUR = {          # store: (family, flags) on 4 ranks; "docs" is filled from docs/caching.md
    "gpt_oss_big_docs": ("gpt_oss_big", None),
    "glm4_moe_tp2_ep2_etp2": ("glm4_moe", ["--tp", "2", "--ep", "2"]),
    "deepseek_v3_tp2_ep2_etp2": ("deepseek_v3", ["--tp", "2", "--ep", "2"]),
}
STORES = {f"{family}_{layout}": family for family, (_, layouts) in FAMILIES.items() for layout in layouts}
STORES.update({name: family for name, (family, _) in ON_FOUR.items()})
"""Every top-K store the matrix writes: {store name: the family (teacher) it is of}."""
KIND_STORES = {f"{KIND_FAMILY}_{layout}_{kind}": (layout, kind) for layout in FAMILIES[KIND_FAMILY][1]
               for kind in KIND_FLAGS}
"""Every other kind's store: {store name: (layout, kind)}."""
REFUSED = {          # name: (family, flags, world, fragment of the one-line error)
    "gpt-oss at expert TP 2": ("gpt_oss", ["--tp", "2", "--ep", "2", "--etp", "2"], 2,
                               "expert_tensor_parallel=2: the model's experts have biases"),
    "expert TP on a dense model": ("llama", ["--etp", "2"], 2, "expert_tensor_parallel=2 but the model has no experts"),
    "experts' grid vs world": ("gpt_oss", ["--tp", "2", "--ep", "4"], 2,
                               "world size 2 is not a multiple of --etp x --ep x --pp = 1 x 4 x 1"),
    "expert TP vs FFN width": ("glm4_moe", ["--ep", "2", "--etp", "3"], 2,
                               "expert_tensor_parallel=3 does not divide the experts' FFN width 32"),
}


def docs_gpt_oss_flags() -> list[str]:
    """The parallel flags of docs/caching.md's gpt-oss-120b ``cache`` command (``--tp``, ``--pp``, ``--ep``, ``--etp``,
    ``--micro-batch-size``): what the test runs at tiny size."""
    text = DOCS.read_text()
    match = re.search(r"^torchrun [^\n]*--teacher /ckpt/gpt-oss-120b(?:[^\n]*\\\n)*[^\n]*$", text, re.MULTILINE)
    assert match, "docs/caching.md has no gpt-oss-120b cache command"
    words = shlex.split(match.group(0).replace("\\\n", " "))
    keep = ("--tp", "--pp", "--ep", "--etp", "--micro-batch-size")
    return [word for i, word in enumerate(words) if word in keep or (i and words[i - 1] in keep)]


def _indexed_data(prefix: str, low: int, high: int, seed: int) -> str:
    """A Megatron indexed dataset of random ids in [low, high) (documents of 5..40 tokens)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for length in rng.integers(5, 40, 12):
        builder.add_document(rng.integers(low, high, length).astype(np.int32), [int(length)])
    builder.finalize(prefix + ".idx")
    return prefix


def _cache_main_on_every_rank(runs: dict) -> dict:
    """The cache command's ``main`` for each ``{name: argv}`` on this rank: ``{name: (exit code, stderr)}``."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.commands import cache

    parallel_state.destroy_model_parallel()            # run_on_ranks' state: each run builds its own
    results = {}
    for name, argv in runs.items():
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = cache.main(argv)
        results[name] = (code, stderr.getvalue())
    return results


def _argv(teacher, data, output, flags, kind_flags=TOPK) -> list[str]:
    return ["--teacher", str(teacher), "--data", data, "--output", str(output), *COMMON, *kind_flags, *flags]


@pytest.fixture(scope="module")
def matrix(tiny_hf_qwen3_moe, tiny_hf_gpt_oss, tmp_path_factory):
    work = tmp_path_factory.mktemp("teacher_matrix")
    teachers = {family: save_tiny_causal_lm(work / family, family, vocab_size=VOCAB, perturb=True, seed=11)
                for family in ("llama", "glm4_moe", "deepseek_v3")}
    teachers["qwen3_moe"], teachers["gpt_oss"] = tiny_hf_qwen3_moe, tiny_hf_gpt_oss
    teachers["gpt_oss_mxfp4"] = save_mxfp4_copy(teachers["gpt_oss"], work / "gpt_oss_mxfp4")
    teachers["gpt_oss_big"] = save_tiny_causal_lm(work / "gpt_oss_big", "gpt_oss", vocab_size=GPT_OSS_VOCAB,
                                                  perturb=True, seed=12)
    small = _indexed_data(str(work / "small"), 0, VOCAB, 0)
    big = _indexed_data(str(work / "big"), 1 << 17, GPT_OSS_VOCAB, 1)              # ids above 2^17
    two = {f"{family}_{layout}": _argv(teachers[family], small, work / f"{family}_{layout}.zarr", flags)
           for family, (_, layouts) in FAMILIES.items() for layout, flags in layouts.items()}
    two.update({name: _argv(teachers[KIND_FAMILY], small, work / f"{name}.zarr", FAMILIES[KIND_FAMILY][1][layout],
                            KIND_FLAGS[kind]) for name, (layout, kind) in KIND_STORES.items()})
    two.update({name: _argv(teachers[family], small, work / "refused.zarr", flags)
                for name, (family, flags, world, _) in REFUSED.items() if world == 2})
    four = {name: _argv(teachers[family], big if family == "gpt_oss_big" else small, work / f"{name}.zarr",
                        docs_gpt_oss_flags() if flags is None else flags,
                        TOPK + (["--head-chunk-bytes", str(2**24)] if family == "gpt_oss_big" else []))
            for name, (family, flags) in ON_FOUR.items()}                # 201,088 ids: blocks of ~8 token rows
    results = run_on_ranks(2, _cache_main_on_every_rank, two, tp=1, timeout=900)
    results += run_on_ranks(4, _cache_main_on_every_rank, four, tp=1, timeout=900)
    return work, teachers, {name: [rank[name] for rank in results if name in rank] for name in {**two, **four}}


def _reference(folder, tokens: torch.Tensor):
    """transformers' float64 log-probs ``[n, S, V]`` and where the K-th/(K+1)-th gap is clear (``[n, S]``)."""
    logprobs = torch.log_softmax(hf_logits(folder, tokens), dim=-1)
    top = torch.topk(logprobs, K + 1, dim=-1).values
    return logprobs, (top[..., K - 1] - top[..., K]) > 1e-5


def _check_store(store, folder, architecture: str, vocab: int) -> float:
    """The store holds transformers' top-K ids (where the gap is clear) and their float64 log-probs; returns the
    largest |log-prob difference|."""
    from megatron_kd_plugin.cache import TopKCacheReader

    reader = TopKCacheReader(store)
    assert reader.spec.vocab_size == vocab and reader.spec.teacher.startswith(f"{architecture}:")
    tokens = torch.stack([reader[i].tokens[:-1] for i in range(NUM_SAMPLES)]).long()          # [n, S]
    logprobs, clear = _reference(folder, tokens)
    assert clear.float().mean() > 0.9
    worst = 0.0
    for i in range(NUM_SAMPLES):
        row = reader[i]
        ids = row.teacher.ids.long()                                                          # [S, K]
        want = torch.topk(logprobs[i], K, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(ids.sort(dim=-1).values[clear[i]], want[clear[i]]), (store, i)
        worst = max(worst, float((row.teacher.logprobs.double() - logprobs[i].gather(-1, ids)).abs().max()))
    return worst


def test_every_run_of_the_matrix_succeeds_on_every_rank(matrix):
    _, _, results = matrix
    for name in [*STORES, *KIND_STORES]:
        assert results[name], name
        for code, stderr in results[name]:
            assert code == 0, f"{name}: exit {code}: {stderr.strip()}"


@pytest.mark.parametrize("family", [*FAMILIES, "gpt_oss_big"])
def test_every_store_holds_transformers_topk_at_every_layout(matrix, family):
    work, teachers, _ = matrix
    architecture = FAMILIES[family][0] if family in FAMILIES else FAMILIES["gpt_oss"][0]
    vocab = GPT_OSS_VOCAB if family == "gpt_oss_big" else (1000 if family == "qwen3_moe" else VOCAB)
    worst = {name: _check_store(work / f"{name}.zarr", teachers[family], architecture, vocab)
             for name, of in STORES.items() if of == family}
    if family == "gpt_oss_big":
        from megatron_kd_plugin.cache import TopKCacheReader

        reader = TopKCacheReader(work / "gpt_oss_big_docs.zarr")
        assert int(reader[0].tokens.min()) >= 1 << 17 and int(reader[0].teacher.ids.max()) >= 1 << 17
    print(f"{family}: max |log-prob - transformers float64| per store: {worst}")
    for name, value in worst.items():
        assert value < 5e-5, (name, value)                      # fp32 codec: float32 compute error only


@pytest.mark.parametrize("kind", list(KIND_FLAGS))
def test_every_kind_at_every_layout_holds_its_rows_of_transformers_logits(matrix, kind):
    """Each kind's store at each layout against the kind's rows of transformers' float64 logits (rounded to float32,
    the same seed's draws) and against its TP=1 store."""
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.store.array_names import IDS, LOGPROBS
    from megatron_kd_plugin.cache.writer import teacher_rows

    work, teachers, _ = matrix
    readers = {layout: TopKCacheReader(work / f"{name}.zarr") for name, (layout, of) in KIND_STORES.items()
               if of == kind}
    first = readers["tp1"]
    tokens = torch.stack([first[i].tokens[:-1] for i in range(NUM_SAMPLES)]).long()              # [n, S]
    logits = hf_logits(teachers[KIND_FAMILY], tokens).transpose(0, 1).float()                    # [S, n, V]
    want, _ = teacher_rows(logits, first.spec, first_sample=0, tp_group=None)
    clear = _reference(teachers[KIND_FAMILY], tokens)[1]                          # [n, S] no tie at the K-th id
    for layout, reader in readers.items():
        for i in range(NUM_SAMPLES):
            row, one = reader[i].teacher, first[i].teacher
            assert torch.equal(row.ids, one.ids), (kind, layout, i)                                # = TP=1 store
            torch.testing.assert_close(row.logprobs, one.logprobs, rtol=0, atol=5e-5)
            where = clear[i] if kind == "top_p" else slice(None)
            assert torch.equal(row.ids.long()[where], want[IDS][:, i][where]), (kind, layout, i)
            torch.testing.assert_close(row.logprobs[where], want[LOGPROBS][:, i][where], rtol=0, atol=5e-5)


def test_combinations_a_model_cannot_take_get_one_line_and_exit_2_before_it_loads(matrix):
    work, _, results = matrix
    assert not (work / "refused.zarr").exists()
    for name, (_, _, _, fragment) in REFUSED.items():
        for code, stderr in results[name]:
            errors = [line for line in stderr.splitlines() if line.startswith("error: ")]    # (warnings aside)
            assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, (name, stderr)
            assert fragment in errors[0], (name, errors[0])
