"""GPU check of the KD student step without Transformer Engine or Megatron-Bridge (tools/gpu_check.sh runs it).

On one GPU: a random megatron-core GPTModel teacher (local layers) writes a top-K cache (``write_cache``); a smaller
GPTModel student (local layers, bf16 through ``Float16Module``, megatron-core DDP + distributed optimizer with the
recipes' overlapped grad reduce / param gather) trains on top-K rows (``KDRows``) through ``kd_forward_step``
under megatron-core's own schedule (``get_forward_backward_func()`` = ``forward_backward_no_pipelining``). Prints
the per-iteration KD loss and the peak GPU memory; exits 1 unless the loss falls.

    python tools/gpu_student_check.py              # on the GPU (~1 min)
    python tools/gpu_student_check.py --dry-run    # the same path on CPU: tiny sizes, bf16 too (cpu_compat)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import types

import numpy as np
import torch
import torch.distributed as dist

SIZES = {  # name: (teacher layers, teacher hidden, student layers, student hidden, vocab, seq, samples, K, iters)
    "gpu": (4, 512, 2, 256, 32768, 1024, 64, 64, 30),
    "dry-run": (2, 64, 1, 32, 512, 32, 8, 8, 6),
}


TEACHER_INIT_STD = 0.25
"""A peaked teacher (student: megatron's 0.02): a distribution worth distilling."""


def model_config(layers: int, hidden: int, *, bf16: bool, init_method_std: float = 0.02):
    """megatron-core derives ``init_method`` from ``init_method_std`` in ``__post_init__``: it must be passed here."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=max(4, hidden // 64), bf16=bf16,
        params_dtype=dtype, pipeline_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(), gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, init_method_std=init_method_std)


def gpt(config, vocab: int, seq: int):
    from megatron.core.models.gpt import GPTModel

    from megatron_kd_plugin.cpu_compat import local_block_spec

    spec = local_block_spec(config)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def write_teacher_cache(store: str, sizes, device) -> None:
    from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
    from megatron_kd_plugin.cache.writer import write_cache

    layers, hidden, _, _, vocab, seq, samples, k, _ = sizes
    config = model_config(layers, hidden, bf16=False, init_method_std=TEACHER_INIT_STD)
    teacher = gpt(config, vocab, seq).to(device).eval()
    std = float(teacher.decoder.layers[0].mlp.linear_fc1.weight.float().std())   # drawn with init_method
    print(f"teacher linear_fc1 weight std {std:.4f} (init_method_std {TEACHER_INIT_STD})", flush=True)
    if abs(std / TEACHER_INIT_STD - 1) > 0.1:
        raise RuntimeError(f"teacher weight std {std:.4f} != init_method_std {TEACHER_INIT_STD}: not a peaked teacher")
    rng = np.random.default_rng(0)
    phrases = rng.integers(0, vocab, size=(64, 16))   # repeated phrases the student can learn
    stream = np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=samples * seq // 16 + 1)])
    source = TokenWindows(stream, seq, num_samples=samples, fingerprint="gpu-check", tokenizer="synthetic",
                          tokenizer_vocab_size=vocab)

    @torch.no_grad()
    def logits_fn(tokens, position_ids):   # [b, s] -> [s, b, V] (stream rows: positions 0..s-1)
        tokens = tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        mask = None if device.type == "cuda" else torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
        return teacher(tokens, positions, mask).transpose(0, 1).float()

    write_cache(source, logits_fn, store, k=k, vocab_size=vocab, teacher="random-gpt", samples_per_shard=8,
                progress=False)


def train_student(store: str, sizes, device, *, micro_batch: int = 4, num_microbatches: int = 2) -> list[float]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from megatron_kd_plugin.bridge.forward_step import kd_forward_step
    from megatron_kd_plugin.cache import KDRows, TopKCacheReader, row_kind
    from megatron_kd_plugin.cpu_compat import megatron_optimizer_on_cpu
    from megatron_kd_plugin.loss import KDLossOptions

    _, _, layers, hidden, vocab, seq, samples, _, iterations = sizes
    config = model_config(layers, hidden, bf16=True)   # bf16 on the CPU dry run too: the same path
    model = Float16Module(config, gpt(config, vocab, seq).to(device))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=True, overlap_param_gather=True,
                                               check_for_nan_in_grad=True)
    with megatron_optimizer_on_cpu():
        ddp = DistributedDataParallel(config, ddp_config, model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, clip_grad=1.0,
                                                           use_distributed_optimizer=True), [ddp])
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    reader = TopKCacheReader(store)
    rows = iterations * micro_batch * num_microbatches
    dataset = KDRows(row_kind(reader, seq_length=seq), np.arange(samples), num_rows=rows, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=micro_batch)
    data_iterator = iter(loader)
    # what kd_forward_step reads of Bridge's state (bridge/config.py's KDConfig needs Bridge, absent on the GPU machine)
    state = types.SimpleNamespace(cfg=types.SimpleNamespace(
        kd=KDLossOptions(), rerun_state_machine=types.SimpleNamespace(
            check_for_nan_in_loss=True)))
    step = functools.partial(kd_forward_step, state)
    forward_backward = get_forward_backward_func()
    ddp.disable_forward_pre_hook(param_sync=False)   # Bridge: pre-hooks on from iteration 2
    losses = []
    for iteration in range(iterations):
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        with megatron_optimizer_on_cpu():   # the schedule allocates with device="cuda"
            reports = forward_backward(forward_step_func=step, data_iterator=data_iterator, model=[ddp],
                                       num_microbatches=num_microbatches, seq_length=seq,
                                       micro_batch_size=micro_batch, forward_only=False)
            ok, grad_norm, _ = optimizer.step()
        if iteration == 0:
            ddp.enable_forward_pre_hook()
        pair = torch.stack([r["kd loss"].float() for r in reports]).sum(0)
        losses.append(float(pair[0] / pair[1]))
        print(f"iteration {iteration:3d}  kd loss {losses[-1]:.5f}  grad norm {float(grad_norm):.4f}  "
              f"{time.perf_counter() - start:.3f} s", flush=True)
    ddp.disable_forward_pre_hook(param_sync=True)
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run the same path on CPU at tiny sizes")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_student_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, seed_model_parallel

    apply_cpu_workarounds()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    seed_model_parallel(1234)
    sizes = SIZES["gpu" if device.type == "cuda" else "dry-run"]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "teacher.zarr")
        write_teacher_cache(store, sizes, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        losses = train_student(store, sizes, device)
    if device.type == "cuda":
        print(f"result: peak GPU memory during training {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    first, last = np.mean(losses[:2]), np.mean(losses[-2:])
    print(f"result: kd loss first two {first:.5f} -> last two {last:.5f} "
          f"({'falls' if last < first else 'DOES NOT FALL'})")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if np.isfinite(losses).all() and last < first else 1


if __name__ == "__main__":
    sys.exit(main())
