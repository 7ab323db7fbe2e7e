"""The demo's CPU training loop and its per-step losses (CE, online dense KD, cached top-K KD).

One loop for every model the demo and the quality benchmark train, so variants differ only in their loss:
each step calls ``loss_step(step) -> (loss_sum, num_tokens, report)`` (megatron-core's 3-tuple loss contract)
on one micro-batch, back-propagates ``loss_sum / num_tokens``, clips, and steps AdamW with linear warm-up
then cosine decay. The losses, per unmasked token t with student logits z_t over the vocabulary V:

    ce_step        -log softmax(z_t)[y_t]                                  (megatron's vocab-parallel CE)
    dense_kd_step  Σ_v p_t[v] (log p_t[v] - log softmax(z_t)[v]),  p_t = the teacher's full softmax, computed
                   on the fly (teacher in the loop: the quality ceiling of distillation)
    topk_kd_step   ``megatron_kd_plugin.loss.topk_kd_loss`` on the cached top-K (fused: the student's lm_head
                   runs inside the loss, via GPTModel's ``output_processor`` hook)

Shapes: samples [N, S+1] int64; a micro-batch's inputs/labels [b, s]; model logits [b, s, V].
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
            history.append({"loss": float(loss), "lr": cfg.lr_at(step), **report})
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


def _causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s = tokens.shape
    return torch.arange(s).unsqueeze(0).expand(b, s), torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def ce_step(model: torch.nn.Module, samples: torch.Tensor, rows: Callable[[int], torch.Tensor]) -> LossStep:
    """Hard-label cross entropy on ``samples[rows(step)]`` (GPTModel's own vocab-parallel CE)."""

    def step_fn(step: int):
        batch = samples[rows(step)]
        inputs, labels = batch[:, :-1], batch[:, 1:]                               # [b, s]
        position_ids, causal = _causal_inputs(inputs)
        per_token = model(inputs, position_ids, causal, labels=labels)             # [b, s]
        return per_token.sum(), torch.tensor(labels.numel()), {}

    return step_fn


def dense_kd_step(model: torch.nn.Module, teacher: torch.nn.Module, samples: torch.Tensor,
                  rows: Callable[[int], torch.Tensor]) -> LossStep:
    """Forward KL from the teacher's full softmax, computed on the fly (TP=1: full logits on one rank)."""
    teacher.eval()

    def step_fn(step: int):
        inputs = samples[rows(step)][:, :-1]                                       # [b, s]
        position_ids, causal = _causal_inputs(inputs)
        with torch.no_grad():
            teacher_lp = torch.log_softmax(teacher(inputs, position_ids, causal).float(), dim=-1)  # [b, s, V]
        student_lp = torch.log_softmax(model(inputs, position_ids, causal).float(), dim=-1)        # [b, s, V]
        kl = torch.sum(teacher_lp.exp() * (teacher_lp - student_lp))
        return kl, torch.tensor(inputs.numel()), {}

    return step_fn


def topk_kd_step(model: torch.nn.Module, cached: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                 rows: Callable[[int], torch.Tensor], *, k: int | None = None, **loss_options) -> LossStep:
    """The fused top-K KD loss on cached rows; ``cached(rows)`` gives batch-first tokens [b, S+1] and
    teacher_ids / teacher_logprobs [b, S, K_cache]; ``k`` keeps the first (highest) k of them."""
    from megatron_kd_plugin.loss import topk_kd_loss

    def processor(hidden_states, output_weight, output_layer, context, **_):
        weight = output_weight if output_weight is not None else output_layer.weight  # [V/tp, H]
        return topk_kd_loss(hidden_states, weight, context["teacher_ids"], context["teacher_logprobs"],
                            labels=context["labels"], **loss_options)

    def step_fn(step: int):
        batch = cached(rows(step))
        inputs, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]           # [b, s]
        position_ids, causal = _causal_inputs(inputs)
        context = dict(labels=labels.t().contiguous(),                             # [s, b]
                       teacher_ids=batch["teacher_ids"][..., :k].transpose(0, 1).contiguous(),          # [s, b, K]
                       teacher_logprobs=batch["teacher_logprobs"][..., :k].float().transpose(0, 1).contiguous())
        result = model(inputs, position_ids, causal, output_processor=processor, output_processor_context=context)
        n = result.num_tokens.clamp(min=1)
        report = {"kd": float(result.kd_sum / n), "student_topk_mass": float(result.student_topk_mass_sum / n),
                  "teacher_topk_mass": float(result.teacher_topk_mass_sum / n)}
        return result.loss_sum, result.num_tokens, report

    return step_fn


def _free_port() -> int:
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
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    seed_model_parallel(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()
