"""Tiny Hugging Face checkpoints made by ``transformers`` inside the tests (random init + ``save_pretrained``):
nothing is downloaded. ``tests/conftest.py`` builds each once per test session.

    folder = save_tiny_causal_lm(tmp / "qwen3", "qwen3", vocab_size=1000)
    folder = save_tiny_causal_lm(tmp / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2)
    folder = save_tiny_causal_lm(tmp / "oss", "gpt_oss", vocab_size=512, perturb=True)   # the teacher matrix's

Each folder holds ``config.json``, ``model.safetensors`` and a word-level tokenizer (``tokenizer.json`` +
``tokenizer_config.json``) whose ``tokenizer_vocab_size`` ids lie inside the model's vocabulary, as a real
checkpoint's do.
"""

from __future__ import annotations

import pathlib

import torch

ARCHITECTURES = {
    # name: (config class, model class) in transformers
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),      # also Kimi-K2's architecture
}

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)
"""The shape every tiny checkpoint shares unless overridden (2 layers, hidden 64, 4 heads in 2 KV groups)."""

TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                norm_topk_prob=True, output_router_logits=False, mlp_only_layers=[])
"""The MoE extras of ``qwen3_moe``: 4 experts, top-2."""

FAMILY_EXTRAS = {
    # what makes each family itself, at tiny size (added to TINY; an override wins)
    "qwen3_moe": TINY_MOE,
    # gpt-oss: layer 0 sliding-window (4 tokens < the tests' 16), layer 1 full; YaRN (its default rope_parameters,
    # which Bridge hard-codes); attention sinks, q/k/v/o biases, router and expert biases (perturbed); 4 experts
    # top-2 as wide as hidden, as in the released models (Bridge 0.6.2 guesses the HF expert layout from the shapes:
    # at 2 x intermediate == hidden it takes gate_up_proj the wrong way round, logits off by ~2 nats, measured)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=4,
                    attention_bias=True, initializer_range=0.1),
    # GLM-4.5: layer 0 dense, layer 1 MoE (4 routed experts top-2 + 1 shared), sigmoid router with a correction
    # bias (perturbed) and routed scaling, q/k/v bias, QK norm, half the head rotated
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                     norm_topk_prob=True, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                     initializer_range=0.1),
    # DeepSeek-V3 / Kimi-K2: multi-latent attention (q and kv low-rank, decoupled rope head, interleaved rope,
    # YaRN with mscale), layer 0 dense, layer 1 MoE: 4 routed experts top-2 in 2 groups (1 chosen) + 1 shared,
    # sigmoid router with a correction bias (perturbed) and routed scaling
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                        norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4, head_dim=8, initializer_range=0.1,
                        max_position_embeddings=163840,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                             original_max_position_embeddings=4096, beta_fast=32.0,
                                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
}
"""Each family's peculiarities at tiny size (``save_tiny_causal_lm(..., perturb=True)`` also randomises the
parameters that hold them, so a converter that drops one changes the logits)."""


@torch.no_grad()
def perturb_small_parameters(model, seed: int) -> None:
    """Set every 1-D parameter and buffer saved with the model (norm weights, biases, attention sinks, router
    correction biases) to random non-default values: norms 1 + N(0, 0.3²), the others N(0, 0.5²). At their
    initial values (ones, zeros) a converter that drops them would go unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():              # what save_pretrained writes; shares storage
        if tensor.ndim != 1 and not name.endswith("_bias"):        # expert biases are [experts, width]
            continue
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        tensor.copy_(1 + 0.3 * noise if "norm" in name else 0.5 * noise)


def save_word_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` ids (``<|endoftext|>`` = 0, ``<unk>`` = 1, then "w2".."wN")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(folder)


def save_tiny_causal_lm(folder, architecture: str = "qwen3", *, vocab_size: int = 1000,
                        tokenizer_vocab_size: int | None = None, seed: int = 0, perturb: bool = False,
                        **overrides) -> pathlib.Path:
    """Save a random-init tiny ``architecture`` causal LM (fp32) and its tokenizer to ``folder``; returns it.
    ``perturb``: :func:`perturb_small_parameters` before saving."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in ARCHITECTURES[architecture])
    fields = {**TINY, **FAMILY_EXTRAS.get(architecture, {}), **overrides}
    config = config_cls(vocab_size=vocab_size, dtype="float32", **fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if perturb:
        perturb_small_parameters(model, seed)
    folder = pathlib.Path(folder)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, tokenizer_vocab_size or vocab_size)
    return folder


def save_mxfp4_copy(source, folder, seed: int = 0) -> pathlib.Path:
    """A copy of the gpt-oss checkpoint at ``source`` whose experts are stored as the released gpt-oss stores them:
    MXFP4 ``*_blocks`` (uint8, two FP4 E2M1 codes per byte, blocks of 32 values along the input dimension) and
    ``*_scales`` (uint8: the block's power-of-two exponent + 127), with ``quantization_config`` in config.json. The
    codes are random and the exponents -7..-5 (values up to 6 · 2^-5): no quantizer is needed, both readers
    dequantize the same bytes. Shapes: gate_up ``[E, 2·I, H/32, 16]`` / ``[E, 2·I, H/32]``, down ``[E, H, I/32, 16]``
    / ``[E, H, I/32]``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, folder = pathlib.Path(source), pathlib.Path(folder)
    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in [name for name in weights if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, width_in, width_out = weights.pop(name).shape                  # HF [E, in, out]
        weights[f"{name}_blocks"] = torch.randint(0, 256, (experts, width_out, width_in // 32, 16),
                                                  generator=generator, dtype=torch.uint8)
        weights[f"{name}_scales"] = torch.randint(127 - 7, 127 - 4, (experts, width_out, width_in // 32),
                                                  generator=generator, dtype=torch.uint8)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@torch.no_grad()
def hf_logits(folder, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own forward of the checkpoint at ``folder``: float64 logits ``[b, s, V]`` of ``tokens [b, s]``
    (an MXFP4 checkpoint dequantized by transformers itself, as it does without CUDA)."""
    import json

    import transformers

    quantized = "quantization_config" in json.loads((pathlib.Path(folder) / "config.json").read_text())
    extra = dict(quantization_config=transformers.Mxfp4Config(dequantize=True)) if quantized else {}
    # the eager experts loop: transformers' default grouped_mm has no float64 kernel
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                              experts_implementation="eager", **extra).eval()
    return model.to(torch.float64)(input_ids=tokens).logits          # (MXFP4 is dequantized to bf16: exact in fp64)


PUBLISHED_QWEN3 = {
    # the published Qwen3 dense shapes (config.json fields) the long-context recipes are planned for
    "0.6b": dict(hidden_size=1024, intermediate_size=3072),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144),
}


def save_published_qwen3_config(folder, size: str) -> pathlib.Path:
    """A config-only HF folder of a published Qwen3 shape (``size`` in PUBLISHED_QWEN3): enough for a recipe's
    architecture (AutoBridge with load_weights=False) and the memory planner, with no weights."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=151936, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"], **PUBLISHED_QWEN3[size])
    folder = pathlib.Path(folder)
    config.save_pretrained(folder)
    return folder
