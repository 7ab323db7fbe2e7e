"""Students from and back to Hugging Face checkpoints, through Megatron-Bridge's ``AutoBridge``.

    folder = resolve_hf_folder("Qwen/Qwen3-0.6B")        # a local folder as is; a hub id: its local snapshot
    provider = student_provider(folder)                   # architecture from config.json (models.hf), no weights
    load_hf_weights(models, folder)                       # the checkpoint's weights into the built chunks
    save_hf(models, folder, "healed/")                    # the (trained) chunks as a HF folder transformers loads

A recipe builds its student with ``student_provider`` and sets ``checkpoint.pretrained_checkpoint`` to the folder:
Bridge's ``pretrain()`` then loads the weights itself (a local HF folder is detected and loaded through
AutoBridge), and with ``checkpoint.also_save_hf_checkpoint`` writes every checkpoint's student to ``iter_*/hf/``
as well; the CPU loop (``cpu_train``) does both with the functions here.
"""

from __future__ import annotations

import pathlib

from megatron_kd_plugin.models.hf import hf_model_provider, is_hf_checkpoint


class HubStudentError(ValueError):
    """A student named by a hub id that the hub could not give (no network, no such repository, not cached)."""

    def __init__(self, hf_path: str, reason: str):
        self.hf_path, self.reason = hf_path, reason
        super().__init__(f"{hf_path!r} is not a local folder, and as a Hugging Face hub id it could not be fetched "
                         f"({reason}); --hf-path takes a local folder (config.json + *.safetensors)")


def resolve_hf_folder(hf_path: str) -> str:
    """``hf_path`` if it is a local HF checkpoint folder; else a hub id, downloaded (or found in the HF cache) as
    a local snapshot: Bridge loads ``checkpoint.pretrained_checkpoint`` only from a local folder. A hub id the hub
    cannot give is a ``HubStudentError`` (one line, the hub's reason shortened)."""
    if is_hf_checkpoint(hf_path):
        return str(hf_path)
    if pathlib.Path(hf_path).exists():
        raise ValueError(f"{hf_path}: a folder without config.json, not a Hugging Face checkpoint")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return snapshot_download(hf_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except (OSError, ValueError, HfHubHTTPError) as error:   # offline / not cached, no such repo, a bad id
        first = (str(error).strip().splitlines() or [""])[0]
        reason = f"{type(error).__name__}: {first[:120]}{'...' if len(first) > 120 else ''}"
        raise HubStudentError(hf_path, reason) from None


def student_provider(hf_path: str, *, tensor_parallel: int = 1, pipeline_parallel: int = 1):
    """The student's ``GPTModelProvider`` from its HF checkpoint (Bridge's convention:
    ``AutoBridge.from_hf_pretrained(...).to_megatron_provider(load_weights=False)``, via ``models.hf``)."""
    provider = hf_model_provider(resolve_hf_folder(hf_path), tensor_parallel=tensor_parallel,
                                 pipeline_parallel=pipeline_parallel, load_weights=False)
    # the checkpoint's own vocabulary, unpadded: what Bridge's setup decides for a model vocabulary that is set
    # (setup.py's _validate_and_set_vocab_size), and what the export writes back; padded rows would enter the
    # student's softmax over the vocabulary as extra logits
    provider.should_pad_vocab = False
    return provider


def _auto_bridge(folder):
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(folder))


def load_hf_weights(models: list, folder) -> None:
    """Load the HF checkpoint at ``folder`` into this rank's model chunks (what Bridge's setup does for a
    ``checkpoint.pretrained_checkpoint`` folder)."""
    _auto_bridge(folder).load_hf_weights(models, hf_path=str(folder))


def save_hf(models: list, source_folder, out_folder) -> pathlib.Path:
    """Write the model chunks as a HF checkpoint folder (config, tokenizer files and architecture from
    ``source_folder``, the student's HF checkpoint); collective: every rank calls it, rank 0 writes."""
    from megatron_kd_plugin.cpu_compat import hf_export_without_modelopt

    hf_export_without_modelopt()
    _auto_bridge(source_folder).save_hf_pretrained(models, str(out_folder), show_progress=False)
    return pathlib.Path(out_folder)
