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


@pytest.fixture(scope="session")
def qwen3_configs(tmp_path_factory):
    """Config-only folders of the published Qwen3-0.6B and -1.7B shapes: {"0.6b": folder, "1.7b": folder}."""
    from tests.hf_models import PUBLISHED_QWEN3, save_published_qwen3_config

    root = tmp_path_factory.mktemp("qwen3_configs")
    return {size: save_published_qwen3_config(root / size, size) for size in PUBLISHED_QWEN3}


@pytest.fixture(scope="session")
def tiny_hf_gpt_oss(tmp_path_factory):
    """A tiny gpt-oss checkpoint folder (2 layers: sliding window 4, then full; 4 experts top-2 with biases; YaRN;
    attention sinks; norms and biases at random values; vocab 512)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "gpt_oss", "gpt_oss", vocab_size=512, perturb=True,
                               seed=11)


@pytest.fixture(scope="session")
def installed_package(tmp_path_factory):
    """The checkout's package installed non-editable into a folder outside it (``tests/test_packaging.py``'s
    ``install_package``), once per test run: the packaging test and the demo's run from an installation share it."""
    from tests.test_packaging import install_package

    return install_package(tmp_path_factory.mktemp("installed") / "site")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS's ``weed``, ``tests/s3_server.py``) started once per session, with the bucket
    ``kdtest``; its ``AWS_*`` variables and an MSC config of the profile ``local`` (``MSC_CONFIG``) are set in this
    process (and so in the subprocesses the tests start) while it runs. Skipped where ``weed`` cannot start."""
    import os

    from tests.s3_server import LocalS3

    folder = tmp_path_factory.mktemp("s3")
    try:
        server = LocalS3.start(folder)
    except RuntimeError as exc:
        pytest.skip(f"no local S3 server: {exc}")
    saved = {name: os.environ.get(name) for name in [*server.env(), "MSC_CONFIG"]}
    os.environ.update(server.env(), MSC_CONFIG=str(server.msc_config(folder / "msc.json")))
    server.create_bucket("kdtest")
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
