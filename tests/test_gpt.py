"""GPTSpec round-trips; build_gpt/save_gpt/load_gpt give the same logits at TP=1 and TP=2 both ways."""

import dataclasses

import pytest
import torch

from megatron_kd_plugin.models.gpt import GPTSpec
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

    from megatron_kd_plugin.models.gpt import gpt_logits

    with torch.no_grad():
        return tensor_parallel.gather_from_tensor_model_parallel_region(gpt_logits(model, TOKENS))  # [s, b, V]


def _set_tp(tp):
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _save_tp1_load_tp2_save_load_tp1(folder):
    """On 2 ranks: build+save at TP=1 (DP=2), load+save at TP=2, load at TP=1; full logits of each phase."""
    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron_kd_plugin.models.gpt import build_gpt, load_gpt, save_gpt

    phases = {"built": {}, "tp2": {}, "back": {}}
    _set_tp(1)
    for name, spec in SPECS.items():
        seed_model_parallel(7)
        model = build_gpt(spec, tp_size=1)
        phases["built"][name] = _full_logits(model)
        save_gpt(model, spec, f"{folder}/tp1/{name}")
    _set_tp(2)
    for name, spec in SPECS.items():
        model, loaded = load_gpt(f"{folder}/tp1/{name}", tp_size=2)
        assert loaded == spec
        phases["tp2"][name] = _full_logits(model)
        save_gpt(model, spec, f"{folder}/tp2/{name}")
    _set_tp(1)
    for name in SPECS:
        phases["back"][name] = _full_logits(load_gpt(f"{folder}/tp2/{name}", tp_size=1)[0])
    return phases


def test_checkpoints_move_between_tp_sizes(tmp_path):
    ranks = run_on_ranks(2, _save_tp1_load_tp2_save_load_tp1, str(tmp_path))     # one spawn, three phases
    built = ranks[0]["built"]
    for name in SPECS:
        assert built[name].shape == (12, 2, 64)
        assert torch.equal(ranks[1]["built"][name], built[name])
        assert torch.equal(ranks[0]["tp2"][name], ranks[1]["tp2"][name])
        torch.testing.assert_close(ranks[0]["tp2"][name], built[name], atol=1e-5, rtol=1e-5)
        assert torch.equal(ranks[0]["back"][name], built[name])   # TP=1 -> TP=2 -> TP=1 is lossless
    state_tp1 = torch.load(tmp_path / "tp1" / "swiglu-gqa-rms-tied" / "model.pt")
    state_tp2 = torch.load(tmp_path / "tp2" / "swiglu-gqa-rms-tied" / "model.pt")
    assert state_tp1.keys() == state_tp2.keys()
    assert all(torch.equal(state_tp1[key], state_tp2[key]) for key in state_tp1)


def test_load_refuses_a_folder_without_a_checkpoint(tmp_path):
    from megatron_kd_plugin.models.gpt import load_gpt

    with pytest.raises(ValueError, match="not a save_gpt checkpoint"):
        load_gpt(tmp_path, tp_size=1)
