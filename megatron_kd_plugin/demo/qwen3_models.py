"""The demo's Hugging Face models, made with ``transformers`` as a user makes them: the Qwen3 teacher (random
init, trained with cross entropy, ``save_pretrained``) and its compressed copy, the student to heal.

Compression (``compress``) is the usual structured pruning of a trained model, both kinds at once:

- **depth**: the decoder layers in ``keep_layers`` are kept, the others dropped (the embeddings, final norm and
  output layer are kept whole);
- **width**: each kept layer's MLP is narrowed to ``mlp_keep`` of its channels, the channels with the largest mean
  activation on calibration text kept (the importance Minitron uses): channel j's importance is the mean over
  calibration tokens of |act(gate_j(x)) · up_j(x)|, the input of ``down_proj``; rows j of ``gate_proj`` and
  ``up_proj`` and column j of ``down_proj`` are kept, in their original order.

Every folder holds ``config.json``, ``model.safetensors`` and the demo's tokenizer as a ``PreTrainedTokenizerFast``
(``<|endoftext|>`` its end-of-text token), so the cache command and the export find it as in any HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch

from megatron_kd_plugin.demo.data import EOD_TOKEN


@dataclasses.dataclass(kw_only=True, frozen=True)
class Qwen3Shape:
    """The teacher's Qwen3 shape (``transformers.Qwen3Config`` fields)."""

    num_hidden_layers: int
    """Decoder layers."""
    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Query heads (even: the cache runs at TP=2)."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention; even)."""
    head_dim: int
    """Width of one head."""
    intermediate_size: int
    """MLP width."""


def save_tokenizer(tokenizer_json: pathlib.Path, folder: pathlib.Path, chat_template: str | None = None) -> None:
    """The demo's ``tokenizer.json`` as a transformers tokenizer in ``folder``, with ``chat_template`` if given (what
    ``apply_chat_template`` and ``cache --input-kind messages`` render conversations with)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token=EOD_TOKEN)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


def new_teacher(shape: Qwen3Shape, vocab_size: int, seq_length: int, eod_id: int, seed: int):
    """A randomly initialised fp32 ``Qwen3ForCausalLM`` (untied embeddings, no dropout)."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=vocab_size, max_position_embeddings=seq_length, rope_theta=10000.0,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=eod_id,
                                      eos_token_id=eod_id, pad_token_id=eod_id, dtype="float32",
                                      **dataclasses.asdict(shape))
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config)


def load(folder, *, eval_mode: bool = True):
    """A HF causal LM folder in fp32, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval() if eval_mode else model


@torch.no_grad()
def mlp_channel_importance(model, calibration: torch.Tensor, micro_batch_size: int = 8) -> dict[int, torch.Tensor]:
    """{layer: [intermediate_size]} mean |input of down_proj| over the calibration tokens ``calibration`` [N, s]."""
    sums, tokens = {}, 0
    hooks = []
    for index, layer in enumerate(model.model.layers):
        def hook(module, args, index=index):
            sums[index] = sums.get(index, 0) + args[0].abs().flatten(0, -2).sum(0).double()
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(hook))
    try:
        for start in range(0, len(calibration), micro_batch_size):
            batch = calibration[start:start + micro_batch_size]
            model(input_ids=batch, use_cache=False)
            tokens += batch.numel()
    finally:
        for h in hooks:
            h.remove()
    return {index: total / tokens for index, total in sums.items()}


@torch.no_grad()
def compress(teacher, keep_layers: tuple[int, ...], mlp_keep: float, calibration: torch.Tensor):
    """The teacher with only ``keep_layers`` and each kept MLP narrowed to ``mlp_keep`` of its channels (module
    docstring); returns a new ``Qwen3ForCausalLM``. ValueError on a layer index or ratio it cannot use."""
    import transformers

    config = teacher.config
    layers = config.num_hidden_layers
    if (not keep_layers or sorted(set(keep_layers)) != list(keep_layers)
            or not all(0 <= i < layers for i in keep_layers)):
        raise ValueError(f"keep_layers={keep_layers}: need increasing layer indices in [0, {layers})")
    if not 0 < mlp_keep <= 1:
        raise ValueError(f"mlp_keep={mlp_keep}: must be in (0, 1]")
    width = max(1, round(config.intermediate_size * mlp_keep))
    importance = mlp_channel_importance(teacher, calibration)
    fields = {**config.to_dict(), "num_hidden_layers": len(keep_layers), "intermediate_size": width}
    if fields.get("layer_types"):   # per-layer attention types: the kept layers'
        fields["layer_types"] = [fields["layer_types"][i] for i in keep_layers]
    student_config = transformers.Qwen3Config(**fields)
    student = transformers.Qwen3ForCausalLM(student_config).to(teacher.dtype)
    state = teacher.state_dict()
    new_state = {}
    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            new_state[name] = tensor
    for new_index, old_index in enumerate(keep_layers):
        channels = importance[old_index].topk(width).indices.sort().values
        prefix, target = f"model.layers.{old_index}.", f"model.layers.{new_index}."
        for name, tensor in state.items():
            if not name.startswith(prefix):
                continue
            short = name[len(prefix):]
            if short in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                tensor = tensor[channels]
            elif short == "mlp.down_proj.weight":
                tensor = tensor[:, channels]
            new_state[target + short] = tensor.clone()
    student.load_state_dict(new_state, strict=True)
    return student.eval()


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
