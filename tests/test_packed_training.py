"""Packed stores in the training loop (issue 49, item 4): a student's rows carry the store's loss mask and positions,
a documents store is read at its own seq_length, blends of stream and packed stores, and the CPU loop end to end.

The stores are cut from JSONL by the cache command's own layouts (``cache.layouts.open_rows``) with the tiny HF
Qwen3's word tokenizer (vocab 1000) and written with ``write_cache`` from a context-free table teacher:
prompt/response pairs packed at S = 32 (the loss mask 0 on prompts and at each document's last token) and at
S = 64, and short texts as one stream at S = 32. One spawned rank trains the tiny recipe (vocab 1000,
kd.alpha = 0.5) on the packed store and recomputes its first step, loss and gradient norm, in float64 from the
student's own logits of each document alone, the stored teacher rows and the stored loss mask, with megatron-core's
normalisation (each microbatch's token mean, averaged) and with ``model.calculate_per_token_loss`` (the step's
token mean).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

S, K, VOCAB = 32, 8, 1000
STEPS = 5


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def _words(rng, low: int, high: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(2, VOCAB, rng.integers(low, high)))


def hand_documents(position_ids: torch.Tensor) -> list[slice]:
    """The documents of one row of position ids [S], by a loop: a new one wherever the position does not count up."""
    starts = [t for t in range(len(position_ids)) if t == 0 or position_ids[t] != position_ids[t - 1] + 1]
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [len(position_ids)])]


def table_teacher(tokens, position_ids=None):
    """A context-free teacher (each document's rows are those of it alone, whatever the attention; the teacher
    forward of packed rows is ``test_packed_teacher.py``'s): next-token logits from a fixed random table of the
    current token, [b, s] -> [s, b, V]; peaked enough for a student to learn from in a few steps."""
    return TEACHER_TABLE[tokens].transpose(0, 1)


TEACHER_TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)) * 3    # [V, V] logits


@pytest.fixture(scope="module")
def stores(tiny_hf_qwen3, tmp_path_factory):
    """{name: store path}: ``packed`` (pairs at S), ``packed64`` (the pairs at 2·S), ``stream`` (texts at S); all of
    the tiny Qwen3's tokenizer."""
    from megatron_kd_plugin.cache.layouts import open_rows
    from megatron_kd_plugin.cache.writer import write_cache

    root = tmp_path_factory.mktemp("packed_training")
    rng = np.random.default_rng(4)             # the first step's two microbatches then count 31 and 43 tokens
    pairs = _jsonl(root / "pairs.jsonl", [{"prompt": _words(rng, 2, 7), "response": _words(rng, 3, 12)}
                                          for _ in range(24)])
    texts = _jsonl(root / "texts.jsonl", [{"text": _words(rng, 20, 60)} for _ in range(12)])
    common = dict(k=K, vocab_size=VOCAB, samples_per_shard=4, progress=False)
    paths = {name: root / f"{name}.zarr" for name in ("packed", "packed64", "stream")}
    write_cache(open_rows(pairs, S, tokenizer=str(tiny_hf_qwen3)), table_teacher, paths["packed"], teacher="table",
                **common)
    write_cache(open_rows(pairs, 2 * S, tokenizer=str(tiny_hf_qwen3)), table_teacher, paths["packed64"],
                teacher="table", **common)
    write_cache(open_rows(texts, S, tokenizer=str(tiny_hf_qwen3)), table_teacher, paths["stream"], teacher="table",
                **common)
    return paths


def config(*overrides: str, seq_length: int = S):
    from megatron_kd_plugin.commands.train import build_config

    return build_config("tiny_gpt_kd_cpu_fp32_config", [f"model.vocab_size={VOCAB}", f"model.seq_length={seq_length}",
                                                        f"dataset.seq_length={seq_length}", *overrides])


def train_rows(cfg, rows: int = 16):
    from megatron.bridge.data.base import DatasetBuildContext

    return cfg.dataset.build_datasets(DatasetBuildContext(train_samples=rows, valid_samples=0, test_samples=0))[0]


def test_rows_of_a_packed_store_carry_its_loss_mask_and_positions(stores):
    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.documents import several_documents

    reader = TopKCacheReader(stores["packed"])
    assert reader.spec.layout == "packed" and reader.spec.seq_length == S
    dataset = train_rows(config(f"dataset.cache_path={stores['packed']}"))
    for i in range(len(dataset)):
        sample, window = dataset.window_of(i)
        row, stored = dataset[i], reader[sample]
        assert window == 0 and row.loss_mask.dtype == torch.float32 and row.position_ids.dtype == torch.int64
        assert torch.equal(row.loss_mask, stored.loss_mask.float()), i
        assert torch.equal(row.position_ids, stored.position_ids), i
        assert torch.equal(row.tokens, stored.tokens[:-1]) and torch.equal(row.labels, stored.tokens[1:]), i
    batch = torch.utils.data.default_collate([dataset[i] for i in range(4)])
    assert several_documents(batch.position_ids) and 0 < batch.loss_mask.mean() < 1


def test_rows_of_a_stream_store_are_windows_as_before(stores):
    """A stream store's rows, here at half its S (two windows a sample): every position counted, 0..S-1."""
    from megatron_kd_plugin.cache import TopKCacheReader

    reader = TopKCacheReader(stores["stream"])
    dataset = train_rows(config(f"dataset.cache_path={stores['stream']}", seq_length=S // 2))
    for i in range(8):
        sample, window = dataset.window_of(i)
        row, begin = dataset[i], window * S // 2
        assert torch.equal(row.tokens, reader[sample].tokens[begin:begin + S // 2])
        assert torch.equal(row.loss_mask, torch.ones(S // 2)) and torch.equal(row.position_ids, torch.arange(S // 2))


def test_a_documents_store_is_read_at_its_own_seq_length_or_refused_in_one_line(stores):
    from megatron_kd_plugin.bridge.config import check_kd_config

    check_kd_config(config(f"dataset.cache_path={stores['packed']}"))
    check_kd_config(config(f"dataset.cache_path={stores['stream']}", seq_length=S // 2))   # a stream: any divisor
    with pytest.raises(ValueError, match=rf"packed.zarr: student seq_length={S // 2}, but the store holds packed "
                                         rf"rows of seq_length={S}, read whole .* set model.seq_length and "
                                         rf"dataset.seq_length to {S}") as error:
        check_kd_config(config(f"dataset.cache_path={stores['packed']}", seq_length=S // 2))
    assert "\n" not in str(error.value)


def test_stream_and_packed_stores_of_one_seq_length_blend_each_row_with_its_own_mask(stores):
    """A blend of a stream and a packed store at their common S: each row is its own store's row, mask and
    positions too; stores whose S cannot serve one student are refused in one line, and so is an ensemble of a
    stream and a packed store (its teachers mix per token, within one row's mask)."""
    from megatron_kd_plugin.bridge.config import check_kd_config

    blend = f"dataset.blend='0.5 {stores['stream']} 0.5 {stores['packed']}'"
    check_kd_config(config(blend))
    dataset = train_rows(config(blend))
    alone = [train_rows(config(f"dataset.cache_path={stores[name]}")) for name in ("stream", "packed")]
    for i in range(len(dataset)):
        part, part_row = dataset.source_of(i)
        row, own = dataset[i], alone[part][part_row]
        assert int(row.source) == part
        for name in ("tokens", "loss_mask", "position_ids"):
            assert torch.equal(getattr(row, name), getattr(own, name)), (i, name)
    assert {dataset.source_of(i)[0] for i in range(len(dataset))} == {0, 1}
    refusals = {   # the packed store at 2·S with a stream store at S: whichever seq_length, one store cannot serve it
        S: rf"packed64.zarr: student seq_length={S}, but the store holds packed rows of seq_length={2 * S}",
        2 * S: rf"stream.zarr: student seq_length={2 * S} does not divide the cached seq_length={S}"}
    for seq_length, message in refusals.items():
        with pytest.raises(ValueError, match=message) as error:
            check_kd_config(config(f"dataset.blend='{stores['stream']} {stores['packed64']}'", seq_length=seq_length))
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"an ensemble's stores must share their layout: .*stream.zarr has 'stream', "
                                         r".*packed.zarr 'packed'"):   # its teachers mix per token: one row's
        check_kd_config(config(f"dataset.ensemble='{stores['stream']} {stores['packed']}'"))


def student_logits(model, batch) -> torch.Tensor:
    """float64 [b, S, V]: the student's logits of each document of each row of ``batch`` run alone (positions 0..,
    causal), put back in place."""
    from megatron_kd_plugin.documents import causal_mask

    rows = []
    for tokens, positions in zip(batch.tokens, batch.position_ids):
        spans = hand_documents(positions)
        rows.append(torch.cat([model(tokens[None, span], torch.arange(span.stop - span.start)[None],
                                     causal_mask(span.stop - span.start))[0] for span in spans]))
    return torch.stack(rows).double()


def reference_loss_sum(model, batch, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss summed over the masked-in tokens of ``batch`` in float64, their count): alpha · forward KL with the
    ghost tail (the stored top-K, tau = 1) + (1 - alpha) · CE of the labels, from the student's own logits."""
    log_q = torch.log_softmax(student_logits(model, batch), dim=-1)                       # [b, S, V]
    ids, log_p = batch.teacher.ids.long(), batch.teacher.logprobs.double()               # [b, S, K]
    p, log_q_ids = log_p.exp(), log_q.gather(-1, ids)
    m, s = p.sum(-1), log_q_ids.exp().sum(-1)
    kl = (p * (log_p - log_q_ids)).sum(-1) + (1 - m) * (torch.log1p(-m) - torch.log1p(-s))
    ce = -log_q.gather(-1, batch.labels[..., None])[..., 0]
    counted = batch.loss_mask != 0
    per_token = torch.where(counted, batch.loss_mask * (alpha * kl + (1 - alpha) * ce), 0.0)
    return per_token.sum(), counted.sum()


def reference_first_step(cfg, microbatches, *, per_token: bool) -> tuple[float, float]:
    """(loss, gradient norm) of the first step of ``cfg``'s student (its initial weights) on ``microbatches``,
    normalised as megatron-core: the mean over microbatches of each one's token mean, or (``per_token``) the sum
    over all of them / their tokens."""
    from megatron_kd_plugin.cpu_compat import seed_model_parallel

    cfg.model.finalize()
    seed_model_parallel(cfg.rng.seed)
    model = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    sums, counts = zip(*(reference_loss_sum(model, batch, cfg.kd.alpha) for batch in microbatches))
    loss = sum(sums) / sum(counts) if per_token else sum(a / b for a, b in zip(sums, counts)) / len(sums)
    loss.backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss), norm


def train_body(store):
    """One rank: the tiny recipe trained on the packed store (STEPS steps; and one step with per-token loss), the
    first step's microbatches, and the float64 reference of that step both ways."""
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu

    overrides = (f"dataset.cache_path={store}", f"dataset.k={K}", "kd.alpha=0.5", f"train.train_iters={STEPS}")
    cfg = config(*overrides)
    rows = train_rows(cfg, rows=4)                # the first step: 2 microbatches of 2 rows, rows 0..3 in order
    microbatches = [torch.utils.data.default_collate([rows[i] for i in pair]) for pair in ((0, 1), (2, 3))]
    _, history = train_on_cpu(config(*overrides), progress=False)
    _, per_token = train_on_cpu(config(*overrides, "train.train_iters=1", "model.calculate_per_token_loss=true"),
                                progress=False)
    return {"history": history, "per token history": per_token,
            "reference": reference_first_step(config(*overrides), microbatches, per_token=False),
            "per token reference": reference_first_step(config(*overrides), microbatches, per_token=True),
            "tokens": [int(batch.loss_mask.sum()) for batch in microbatches]}


@pytest.fixture(scope="module")
def trained(stores):
    from tests.distributed import run_on_ranks

    return run_on_ranks(1, train_body, stores["packed"], timeout=600)[0]


def test_the_first_step_on_a_packed_store_equals_the_float64_loss_of_its_masked_tokens(trained):
    """history[0] is the step of the initial weights: its loss and gradient norm equal the float64 reference of
    the documents alone (masked-in tokens only, each microbatch's mean, averaged); the loss falls over the steps."""
    first, (loss, norm) = trained["history"][0], trained["reference"]
    assert trained["tokens"][0] != trained["tokens"][1]             # microbatches of other token counts
    assert math.isclose(first["loss"], loss, rel_tol=1e-6), (first, loss)
    assert math.isclose(first["grad norm"], norm, rel_tol=1e-5), (first, norm)
    kd = [row["kd loss"] for row in trained["history"]]
    assert len(kd) == STEPS and kd[-1] < kd[0], kd


def test_calculate_per_token_loss_divides_by_the_steps_masked_in_tokens(trained):
    """``model.calculate_per_token_loss``: the step's loss and gradients are its summed loss over the tokens of
    both microbatches (megatron-core's finalize_model_grads), not each microbatch's mean."""
    first, (loss, norm) = trained["per token history"][0], trained["per token reference"]
    assert not math.isclose(loss, trained["reference"][0], rel_tol=1e-3)   # the two normalisations differ here
    assert math.isclose(first["loss"], loss, rel_tol=1e-6), (first, loss)
    assert math.isclose(first["grad norm"], norm, rel_tol=1e-5), (first, norm)
