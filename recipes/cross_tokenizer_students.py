"""Cross-tokenizer distillation: a student with its own tokenizer learns from a teacher's cache
(``megatron_kd_plugin.loss.cross_tokenizer``): the token-level term (at every student position, the teacher's
candidates read as the student's next token through their first student tokens) and, with ``kd.token_weight`` < 1,
the approximate-likelihood-matching segment term. Measured (docs/cross-tokenizer.md), students trained from random weights: the
token-level term alone (``kd.token_weight=1``, ``kd.alpha=0.5``) wins 0.93 of the same-tokenizer KD gain against a
related tokenizer (byte-level BPE against byte-level BPE) and 0.35 against an unrelated one (a Unigram against a
byte-level BPE); the segment term cost quality in both, so these recipes leave it out.

The cache must be written with ``--cross-tokenizer`` (each token's realised log-prob and the teacher tokenizer's
byte table) and a top-K; ``dataset.student_tokenizer`` is the student's tokenizer (a HF student's checkpoint folder
by default), and every cached sample is re-tokenised by it and cut at a segment boundary to the student's seq_length.

    python -m megatron_kd_plugin cache --teacher /models/Llama-3.1-8B --data text.jsonl --seq-length 8192 \
        --topk 100 --cross-tokenizer --output outputs/caches/llama3_8b_xtok_8k.zarr
    python -m megatron_kd_plugin train --recipe llama3_8b_to_qwen3_0p6b_xtok_kd_8k_1gpu_h200_bf16_config \
        --hf-path /models/qwen3-0.6b dataset.cache_path=outputs/caches/llama3_8b_xtok_8k.zarr
"""

from __future__ import annotations

from megatron_kd_plugin.bridge.config import KDConfigContainer
from .common import kd_hf_student_config
from .qwen3 import QWEN3_0P6B
from .tiny import tiny_gpt_kd_cpu_fp32_config


def llama3_8b_to_qwen3_0p6b_xtok_kd_8k_1gpu_h200_bf16_config(hf_path: str = QWEN3_0P6B) -> KDConfigContainer:
    """A Llama-3-8B cache (written with --cross-tokenizer) -> a Qwen3-0.6B student with its own tokenizer, 8K
    student tokens a row (Qwen3's and Llama 3's token counts on English text are within a few percent, so a row
    keeps nearly all of a cached 8K sample), one H200; the token-level term mixed half and half with the student's
    CE at the tokens it covers."""
    cfg = kd_hf_student_config(hf_path, cache_path="outputs/caches/llama3_8b_xtok_8k.zarr",
                               run_name="llama3_8b_to_qwen3_0p6b_xtok_kd_8k", seq_length=8192)
    cfg.dataset.student_tokenizer = cfg.checkpoint.pretrained_checkpoint   # the student's folder: tokenizer.json
    cfg.kd.alpha, cfg.kd.token_weight = 0.5, 1.0
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 64, 2
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False     # one rank: nothing to overlap
    return cfg


def tiny_gpt_xtok_kd_cpu_fp32_config() -> KDConfigContainer:
    """The tiny CPU student of ``tiny_gpt_kd_cpu_fp32_config`` with its own tokenizer
    (``dataset.student_tokenizer``, default ``outputs/tokenizers/tiny_student.json``) on a --cross-tokenizer cache."""
    cfg = tiny_gpt_kd_cpu_fp32_config()
    cfg.dataset.student_tokenizer = "outputs/tokenizers/tiny_student.json"
    cfg.dataset.cache_path = "outputs/caches/tiny_teacher_xtok.zarr"
    cfg.kd.alpha, cfg.kd.token_weight = 0.5, 1.0
    return cfg
