"""The student side of packed rows (issue 49, item 4 and proof 5(b)): a KD step on a row of several documents equals
the steps on each document alone, and the pieces that make it so.

- ``megatron_kd_plugin.documents`` against hand-written references: the block-diagonal mask against a loop over
  documents, and float64 dense attention under it against each document's own attention; the THD
  ``PackedSeqParams`` of a known batch.
- The KD step (``kd_forward_step``) on a real megatron-core GPTModel (the tiny recipe's student: non-TE layers, CPU,
  fp32) over gloo at TP = 1 and TP = 2, with RoPE and with learned absolute positions: a batch of a packed row (three
  documents, positions restarting, loss mask 0 at each document's last token and on a prompt) and a stream row gives
  the summed loss, token count and every parameter gradient of the four documents run alone, each as its own row;
  so does the step's THD path (rows folded, ``PackedSeqParams``), through a stand-in for TE's attention that runs
  each packed sequence alone.
- The refusals: several documents under context or pipeline parallelism, documents stores with CP/PP > 1 before step
  one, a cross-tokenizer student on a documents store.

One spawned call (2 ranks, ~15 s): both ranks run the TP = 1 steps, then the same two processes the TP = 2 ones.
"""

from __future__ import annotations

import functools
import re
import types

import pytest
import torch

from tests.distributed import run_on_ranks

S, K, V = 32, 6, 256                       # the tiny recipe's seq_length and vocabulary
DOCUMENTS = (12, 7, 13)                    # the packed row's documents (lengths summing to S)
PROMPT = 3                                 # the first document's first tokens are a prompt (loss mask 0)


def positions_of(lengths) -> torch.Tensor:
    """int64 [sum(lengths)]: 0.. restarting at each document."""
    return torch.cat([torch.arange(n) for n in lengths])


def hand_documents(position_ids: torch.Tensor) -> list[list[int]]:
    """Each row's document index per position, by a loop: a new document wherever the position does not count up."""
    rows = []
    for row in position_ids.tolist():
        index, documents = 0, []
        for t, position in enumerate(row):
            index += t > 0 and position != row[t - 1] + 1
            documents.append(index)
        rows.append(documents)
    return rows


def test_mask_is_block_diagonal_causal_and_its_attention_is_each_documents_own():
    from megatron_kd_plugin.documents import causal_mask, document_attention_mask, several_documents

    position_ids = torch.stack([positions_of((5, 1, 8, 2)), torch.arange(16),
                                torch.cat([torch.arange(9, 15), torch.arange(10)])])   # [3, 16]: a row cut mid-document
    documents = hand_documents(position_ids)
    expected = torch.tensor([[[j > i or row[i] != row[j] for j in range(16)] for i in range(16)] for row in documents])
    mask = document_attention_mask(position_ids)
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 16, 16)
    assert torch.equal(mask[:, 0], expected)
    assert torch.equal(mask[1:2], causal_mask(16))                          # a stream row: plain causal
    assert several_documents(position_ids) and several_documents(position_ids[2:])
    assert not several_documents(position_ids[1:2]) and not several_documents(torch.arange(9, 25)[None])

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))   # [b, S, d]
    scores = (q @ k.transpose(1, 2)).masked_fill(mask[:, 0], -torch.inf)
    attended = scores.softmax(-1) @ v                                       # [b, S, d]
    for r, row in enumerate(documents):
        for d in set(row):
            span = [t for t, doc in enumerate(row) if doc == d]
            own = (q[r, span] @ k[r, span].t()).masked_fill(causal_mask(len(span))[0, 0], -torch.inf)
            torch.testing.assert_close(attended[r, span], own.softmax(-1) @ v[r, span], rtol=0, atol=1e-14)


def test_packed_seq_params_fold_the_rows_into_one_thd_sequence():
    from megatron_kd_plugin.documents import packed_seq_params

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2],
                                 [0, 1, 2, 3, 4, 5, 6, 7],
                                 [5, 6, 7, 0, 1, 2, 3, 4]])
    params = packed_seq_params(position_ids)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 8, 16, 19, 24]
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == params.max_seqlen_kv == 8


def packed_batch():
    """A batch of 2 rows of S tokens (a ``KDRow``, batch-first): row 0 packs ``DOCUMENTS`` (positions restarting,
    loss mask 0 at each document's last token, whose label is the next document's first token, and on the first
    document's prompt), row 1 is a stream row (one document, every label counted); teacher: random top-K ids and
    log-probs over the full vocabulary."""
    from megatron_kd_plugin.cache import KDRow
    from megatron_kd_plugin.loss import TopKTeacher

    gen = torch.Generator().manual_seed(3)
    stream = torch.randint(0, V, (2, S + 1), generator=gen)
    loss_mask = torch.ones(2, S)
    ends = torch.tensor(DOCUMENTS).cumsum(0) - 1
    loss_mask[0, ends] = 0
    loss_mask[0, :PROMPT] = 0
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(2 * S)]).view(2, S, K)
    logprobs = (torch.randn(2, S, K, generator=gen) * 2).log_softmax(-1) - 0.2   # top-K mass exp(-0.2)
    positions = torch.stack([positions_of(DOCUMENTS), torch.arange(S)])
    return KDRow(stream[:, :-1], stream[:, 1:], loss_mask, positions, TopKTeacher(ids, logprobs))


def documents_alone(batch) -> list:
    """Each document of ``packed_batch()`` as its own one-row batch (positions 0.., its slice of every tensor)."""
    from megatron_kd_plugin.loss import tensor_map

    pieces, start = [], 0
    for length in DOCUMENTS:
        pieces.append((0, slice(start, start + length)))
        start += length
    pieces.append((1, slice(0, S)))
    return [tensor_map(lambda t, row=row, span=span: t[row:row + 1, span].clone(), batch)
            ._replace(position_ids=torch.arange(span.stop - span.start)[None]) for row, span in pieces]


def _step(state, model, batches) -> dict:
    """Summed loss, token count and parameter gradients of ``kd_forward_step`` on each batch (backward of each
    loss sum, gradients accumulating)."""
    from megatron_kd_plugin.bridge.forward_step import kd_forward_step

    model.zero_grad(set_to_none=True)
    loss, tokens = 0.0, 0
    for batch in batches:
        output, loss_func = kd_forward_step(state, iter([batch]), model)
        loss_sum, num_tokens, _ = loss_func(output)
        loss_sum.backward()
        loss, tokens = loss + float(loss_sum.detach()), tokens + int(num_tokens)
    return {"loss": loss, "tokens": tokens,
            "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()}}


class TEDotProductAttentionStandIn(torch.nn.Module):
    """Named as Transformer Engine's core attention, which the KD step looks for (``documents.document_attention``)."""


class THDGPTModel(torch.nn.Module):
    """Stands in for a GPTModel on Transformer Engine's THD attention (TE needs CUDA): the step's folded rows
    [1, b·S] are cut at ``cu_seqlens`` and each packed sequence runs through the real CPU model alone; their final
    hidden states, concatenated [b·S, 1, H], go to the step's output processor with the model's lm_head."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt, self.attention = gpt, TEDotProductAttentionStandIn()
        self.config, self.pg_collection = gpt.config, gpt.pg_collection

    def forward(self, *, input_ids, position_ids, attention_mask, labels, output_processor, output_processor_context,
                packed_seq_params):
        from megatron_kd_plugin.documents import causal_mask

        assert attention_mask is None and input_ids.shape[0] == 1 and packed_seq_params.qkv_format == "thd"
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        hidden = torch.cat([self.gpt(input_ids[:, a:b], position_ids[:, a:b], causal_mask(b - a),
                                     output_processor=lambda *, hidden_states, **_: hidden_states)
                            for a, b in zip(bounds, bounds[1:])])                               # [b·S, 1, H]
        return output_processor(hidden_states=hidden, output_layer=self.gpt.output_layer, output_weight=None,
                                context=output_processor_context)


def _student_case(tp: int, position_embedding: str) -> dict:
    """The packed batch vs its documents alone at tensor parallelism ``tp`` (this rank's gradient shards)."""
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state

    from megatron_kd_plugin.commands.train import build_config
    from megatron_kd_plugin.cpu_compat import seed_model_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = build_config("tiny_gpt_kd_cpu_fp32_config", [
        "dataset.cache_path=unused.zarr", f"model.tensor_model_parallel_size={tp}", "kd.alpha=0.5",
        "kd.temperature=1.5", f"model.position_embedding_type={position_embedding}"])
    cfg.model.finalize()
    seed_model_parallel(cfg.rng.seed)
    model = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    state = GlobalState()
    state.cfg = cfg
    batch = packed_batch()
    packed, alone = _step(state, model, [batch]), _step(state, model, documents_alone(batch))
    across = _step(state, model, [batch._replace(position_ids=torch.arange(S).expand(2, S))])  # attends across
    thd = _step(state, THDGPTModel(model), [batch])
    thd["grads"] = {name.removeprefix("gpt."): grad for name, grad in thd["grads"].items()}
    errors = {name: float((packed["grads"][name] - grad).abs().max()) for name, grad in alone["grads"].items()}
    thd_errors = {name: float((thd["grads"][name] - grad).abs().max()) for name, grad in alone["grads"].items()}
    return {"packed": packed["loss"], "alone": alone["loss"], "across": across["loss"], "thd": thd["loss"],
            "tokens": (packed["tokens"], alone["tokens"], thd["tokens"]), "grad_errors": errors,
            "thd_grad_errors": thd_errors,
            "grad_scale": max(float(g.abs().max()) for g in alone["grads"].values()),
            "names": sorted(alone["grads"])}


def _student_body() -> dict:
    return {(tp, embedding): _student_case(tp, embedding) for tp in (1, 2) for embedding in ("rope", "learned_absolute")}


@pytest.fixture(scope="module")
def student_runs():
    return run_on_ranks(2, _student_body, tp=1, timeout=300)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("embedding", ["rope", "learned_absolute"])
def test_a_step_on_a_packed_row_equals_the_steps_on_each_document_alone(student_runs, tp, embedding):
    """Loss sum, token count and every parameter's gradient (this rank's shard at TP = 2) of the packed batch equal
    the sums over its documents run alone, on megatron-core's local attention (the mask) and as THD packed sequences
    (``THDGPTModel``: the step's folding, ``cu_seqlens`` and the loss's [b·S, 1] order), to fp32 rounding (measured: 1e-7 relative, gradients 3e-7 of their
    largest); attending across the documents (the same rows with stream positions) moves the loss by ~1e-3 of it
    (an untrained student attends almost uniformly), far beyond that."""
    for rank in student_runs:
        case = rank[(tp, embedding)]
        expected_tokens = 2 * S - len(DOCUMENTS) - PROMPT
        assert case["tokens"] == (expected_tokens,) * 3
        assert case["packed"] == pytest.approx(case["alone"], rel=1e-6, abs=0), case
        assert case["thd"] == pytest.approx(case["alone"], rel=1e-6, abs=0), case
        assert abs(case["across"] - case["alone"]) > 1e-4 * abs(case["alone"]), case
        assert case["grad_scale"] > 0 and len(case["names"]) >= 10
        for errors in (case["grad_errors"], case["thd_grad_errors"]):
            worst = max(errors.items(), key=lambda item: item[1])
            assert worst[1] <= 1e-6 * max(1.0, case["grad_scale"]), (worst, case["grad_scale"])
    one = student_runs[0][(1, embedding)]
    assert student_runs[0][(tp, embedding)]["packed"] == pytest.approx(one["packed"], rel=1e-6)   # TP-invariant


def test_several_documents_are_refused_under_context_and_pipeline_parallelism():
    from megatron_kd_plugin.bridge.config import check_document_parallelism
    from megatron_kd_plugin.bridge.forward_step import get_kd_batch, row_attention

    batch = packed_batch()
    with pytest.raises(ValueError, match=r"^model.context_parallel_size=2 with rows of several documents"):
        row_attention(batch.position_ids, attention="mask", device=torch.device("cpu"), cp_size=2)
    for first, last in ((True, False), (False, True)):
        with pytest.raises(ValueError, match=r"^model.pipeline_model_parallel_size > 1 with rows of several"):
            get_kd_batch(iter([batch]), is_first_stage=first, is_last_stage=last)
    stream = batch._replace(position_ids=torch.arange(S).expand(2, S))
    assert get_kd_batch(iter([stream]), is_first_stage=True, is_last_stage=False)[0].labels is None   # as before
    for name in ("context_parallel_size", "pipeline_model_parallel_size"):
        model = types.SimpleNamespace(context_parallel_size=1, pipeline_model_parallel_size=1)
        setattr(model, name, 2)
        with pytest.raises(ValueError, match=rf"^model.{name}=2 with packed.zarr, whose rows hold several documents"):
            check_document_parallelism(model, ["packed.zarr"])
        check_document_parallelism(model, [])                               # stream stores: any parallelism


def test_rows_of_one_document_keep_the_plain_causal_attention():
    """A batch whose every row is one document (a stream store's, or windows cut inside documents) gets exactly
    the mask the step gave before packed rows existed, and no packed sequences, with or without TE attention."""
    from megatron_kd_plugin.bridge.forward_step import row_attention
    from megatron_kd_plugin.documents import ATTENTIONS, causal_mask

    positions = torch.stack([torch.arange(S), torch.arange(S) + 40])
    for kind in ATTENTIONS:
        attention = row_attention(positions, attention=kind, device=torch.device("cpu"))
        assert attention.packed_seq_params is None and torch.equal(attention.attention_mask, causal_mask(S))
    packed = row_attention(packed_batch().position_ids, attention="packed_sequences", device=torch.device("cpu"))
    assert packed.attention_mask is None
    assert packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 12, 19, 32, 64]


def test_a_cross_tokenizer_student_refuses_a_documents_store():
    from megatron_kd_plugin.cache.rows.cross_tokenizer_rows import CrossTokenizerRows

    reader = types.SimpleNamespace(spec=types.SimpleNamespace(documents=True, layout="packed"), path="chat.zarr")
    with pytest.raises(ValueError, match=r"^chat.zarr holds packed rows and a student with its own tokenizer"):
        CrossTokenizerRows(reader, seq_length=S, student=object())


def test_rows_of_several_documents_are_refused_where_a_window_layer_drops_their_mask(monkeypatch):
    """megatron-core's own local softmax (as on a GPU without Transformer Engine) lets a packed row's documents see
    one another on a sliding-window layer; the KD step and the teacher refuse such rows there in one line, and take
    them where ``cpu_compat`` masks both (rows of one document pass either way)."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from megatron_kd_plugin.bridge.forward_step import row_attention
    from megatron_kd_plugin.cache.teacher_forward import TeacherForward
    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds
    from megatron_kd_plugin.documents import WINDOW_DROPS_MASK, document_attention, document_attention_mask

    apply_cpu_workarounds()
    model = torch.nn.Sequential(FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func,
                                                      True, None, window_size=(4, 0)))
    positions = torch.cat([torch.arange(5), torch.arange(3)])[None]         # [1, 8]: documents of 5 and 3 tokens
    mask = document_attention_mask(positions)                               # [1, 1, 8, 8]
    scores = torch.randn(1, 1, 8, 8, dtype=torch.float64)

    def crossing():                             # attention the second document pays the first (the softmax masks
        return float(model[0](scores.clone(), mask)[..., 5:, :5].sum())     # its input in place)

    assert document_attention(model) == "mask" and crossing() == 0
    monkeypatch.setattr(FusedScaleMaskSoftmax, "forward_torch_softmax",
                        FusedScaleMaskSoftmax.forward_torch_softmax.__wrapped__)   # megatron-core's own
    assert crossing() > 0.1                                                 # the bug the refusal is for
    assert document_attention(model) == "window_drops_mask"
    assert document_attention(torch.nn.Sequential(torch.nn.Linear(2, 2))) == "mask"   # no window layer
    teacher = types.SimpleNamespace(cp_group=None, attention="window_drops_mask")
    for attend in (functools.partial(row_attention, attention="window_drops_mask", device=torch.device("cpu")),
                   lambda p: TeacherForward._inputs(teacher, torch.zeros_like(p), p, False)):
        with pytest.raises(ValueError, match="^" + re.escape(WINDOW_DROPS_MASK) + "$"):
            attend(positions)
        attend(torch.arange(8)[None])                                       # one document: plain causal
