"""The teachers' CPU training loop: cross entropy on token windows, before any cache exists (a megatron-core GPT's,
``ce_step``, or a transformers model's, ``hf_ce_step``).

Students train through the Megatron-Bridge CPU path (``megatron_kd_plugin.bridge.cpu_train``), which reads a
teacher cache; the teacher comes first and has none, so it trains here on the same contract: each step calls
``loss_step(step) -> (loss_sum, num_tokens, report)`` (megatron-core's 3-tuple loss) on one micro-batch,
back-propagates ``loss_sum / num_tokens``, clips, and steps AdamW with linear warm-up then cosine decay.

Shapes: samples [N, S+1] int64; a micro-batch's inputs/labels [b, s].
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import socket
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

LossStep = Callable[[int], tuple[torch.Tensor, torch.Tensor, dict[str, float]]]


@dataclasses.dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Optimisation settings shared by every model the demo trains."""

    steps: int
    """Optimizer steps (one micro-batch each)."""
    micro_batch_size: int = 8
    """Samples per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at ``lr * min_lr_ratio``."""
    warmup_steps: int = 10
    """Linear warm-up steps (capped at steps // 2)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""

    def __post_init__(self):
        if self.steps < 1 or self.micro_batch_size < 1:
            raise ValueError(f"steps and micro_batch_size must be >= 1, got {self.steps}, {self.micro_batch_size}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got lr={self.lr}, "
                             f"min_lr_ratio={self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        warmup = min(self.warmup_steps, self.steps // 2)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: torch.nn.Module, loss_step: LossStep, cfg: TrainConfig, *, desc: str) -> list[dict[str, float]]:
    """Runs ``cfg.steps`` steps; returns per step {"loss": loss_sum / num_tokens, "lr": ..., **report}."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    model.train()
    history = []
    with tqdm(range(cfg.steps), desc=desc, unit="step") as bar:
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, num_tokens, report = loss_step(step)
            loss = loss_sum / num_tokens.clamp(min=1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            history.append({"loss": loss.item(), "lr": cfg.lr_at(step), **report})
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
    return history


def micro_batches(samples: torch.Tensor, micro_batch_size: int, seed: int) -> Callable[[int], torch.Tensor]:
    """Step -> row indices of ``samples``: epochs of seeded permutations, so any step's batch is reproducible."""
    n = len(samples)
    if n < micro_batch_size:
        raise ValueError(f"{n} samples cannot fill one micro-batch of {micro_batch_size}")
    per_epoch = n // micro_batch_size

    def rows(step: int) -> torch.Tensor:
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        return order[k * micro_batch_size:(k + 1) * micro_batch_size]

    return rows


def causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTModel's position_ids [b, s] and causal attention mask [1, 1, s, s] (True = masked) for tokens [b, s]."""
    b, s = tokens.shape
    return torch.arange(s).unsqueeze(0).expand(b, s), torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def ce_step(model: torch.nn.Module, samples: torch.Tensor, rows: Callable[[int], torch.Tensor]) -> LossStep:
    """Hard-label cross entropy on ``samples[rows(step)]`` (GPTModel's own vocab-parallel CE)."""

    def step_fn(step: int):
        batch = samples[rows(step)]
        inputs, labels = batch[:, :-1], batch[:, 1:]                               # [b, s]
        position_ids, causal = causal_inputs(inputs)
        per_token = model(inputs, position_ids, causal, labels=labels)             # [b, s]
        return per_token.sum(), torch.tensor(labels.numel()), {}

    return step_fn


def hf_ce_step(model: torch.nn.Module, samples: torch.Tensor, rows: Callable[[int], torch.Tensor]) -> LossStep:
    """Hard-label cross entropy of a transformers causal LM on ``samples[rows(step)]`` (its own causal mask)."""

    def step_fn(step: int):
        batch = samples[rows(step)]
        inputs, labels = batch[:, :-1], batch[:, 1:]                               # [b, s]
        logits = model(input_ids=inputs).logits                                    # [b, s, V]
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return loss_sum, torch.tensor(labels.numel()), {}

    return step_fn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_megatron(seed: int) -> Iterator[None]:
    """A one-rank gloo group with megatron-core's parallel state at TP=1, for in-process training and eval."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, seed_model_parallel

    apply_cpu_workarounds()
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    seed_model_parallel(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()
