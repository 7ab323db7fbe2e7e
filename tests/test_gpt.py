"""GPTSpec round-trips; build_gpt/save_gpt/load_gpt give the same logits at TP=1 and TP=2 both ways."""

import dataclasses

import pytest
import torch

from megatron_kd_plugin.gpt import GPTSpec
from tests.distributed import run_on_ranks

SPECS = {
    "gelu-mha": GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
                        seq_length=12),
    "swiglu-gqa-rms-tied": GPTSpec(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=40, vocab_size=64, seq_length=12, normalization="RMSNorm",
                                   activation="swiglu", share_embeddings_and_output_weights=True,
                                   add_bias_linear=False),
}
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def test_spec_json_round_trip():
    for spec in SPECS.values():
        assert GPTSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(hidden_size=30), dict(activation="relu"),
                                 dict(normalization="BatchNorm"), dict(position_embedding_type="alibi")])
def test_spec_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        dataclasses.replace(SPECS["gelu-mha"], **bad)


def test_spec_rejects_tp_that_does_not_divide():
    with pytest.raises(ValueError, match="vocab_size"):
        dataclasses.replace(SPECS["gelu-mha"], vocab_size=66).check_tp(4)


def _full_logits(model):
    from megatron.core import tensor_parallel

    from megatron_kd_plugin.gpt import gpt_logits

    with torch.no_grad():
        return tensor_parallel.gather_from_tensor_model_parallel_region(gpt_logits(model, TOKENS))  # [s, b, V]


def _build_and_save(folder, tp):
    """Fresh models (seeded) saved at this TP size; returns their full logits."""
    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron_kd_plugin.gpt import build_gpt, save_gpt

    out = {}
    for name, spec in SPECS.items():
        seed_model_parallel(7)
        model = build_gpt(spec, tp_size=tp)
        out[name] = _full_logits(model)
        save_gpt(model, spec, f"{folder}/{name}")
    return out


def _load(folder, tp):
    from megatron_kd_plugin.gpt import load_gpt

    out = {}
    for name, spec in SPECS.items():
        model, loaded = load_gpt(f"{folder}/{name}", tp_size=tp)
        assert loaded == spec
        out[name] = _full_logits(model)
    return out


def _load_then_save(src, dst, tp):
    from megatron_kd_plugin.gpt import load_gpt, save_gpt

    out = _load(src, tp)
    for name in SPECS:
        model, spec = load_gpt(f"{src}/{name}", tp_size=tp)
        save_gpt(model, spec, f"{dst}/{name}")
    return out


def test_checkpoints_move_between_tp_sizes(tmp_path):
    saved_tp1 = run_on_ranks(1, _build_and_save, str(tmp_path / "tp1"), 1)[0]
    at_tp2 = run_on_ranks(2, _load_then_save, str(tmp_path / "tp1"), str(tmp_path / "tp2"), 2)
    back_at_tp1 = run_on_ranks(1, _load, str(tmp_path / "tp2"), 1)[0]
    for name in SPECS:
        assert saved_tp1[name].shape == (12, 2, 64)
        assert torch.equal(at_tp2[0][name], at_tp2[1][name])
        torch.testing.assert_close(at_tp2[0][name], saved_tp1[name], atol=1e-5, rtol=1e-5)
        assert torch.equal(back_at_tp1[name], saved_tp1[name])   # TP=1 -> TP=2 -> TP=1 is lossless
    state_tp1 = torch.load(tmp_path / "tp1" / "swiglu-gqa-rms-tied" / "model.pt")
    state_tp2 = torch.load(tmp_path / "tp2" / "swiglu-gqa-rms-tied" / "model.pt")
    assert state_tp1.keys() == state_tp2.keys()
    assert all(torch.equal(state_tp1[key], state_tp2[key]) for key in state_tp1)


def test_load_refuses_a_folder_without_a_checkpoint(tmp_path):
    from megatron_kd_plugin.gpt import load_gpt

    with pytest.raises(ValueError, match="not a save_gpt checkpoint"):
        load_gpt(tmp_path, tp_size=1)
