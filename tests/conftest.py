"""Session-wide fixtures shared across test modules: one tiny HF checkpoint of each architecture, built once."""

from __future__ import annotations

import pytest

from tests.hf_models import save_tiny_causal_lm


@pytest.fixture(scope="session")
def tiny_hf_qwen3(tmp_path_factory):
    """A tiny dense Qwen3 checkpoint folder (2 layers, hidden 64, vocab 1000, tokenizer of 1000 ids)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3", vocab_size=1000)


@pytest.fixture(scope="session")
def tiny_hf_qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint folder (2 layers, 4 experts top-2, vocab 1000)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "qwen3_moe", "qwen3_moe", vocab_size=1000, seed=1)
