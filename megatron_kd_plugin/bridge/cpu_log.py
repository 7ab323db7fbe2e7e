"""What the CPU loop (``cpu_train``) shows of a run while it runs, as Bridge's training loop shows it.

    log = StepLog(state, start_step=resumed_step, tokens_per_step=global_batch * seq_length, print_lines=True)
    log.step(row, seconds)    # row = {"step", "loss", "lr", "grad norm", "kd loss", ["lm loss"]}
    log.close()

- every ``logger.log_interval`` steps (and at the last one) one line on rank 0, Bridge's fields:
  ``iteration  20/ 100 | consumed samples: 160 | tokens/s: 9,876 | learning rate: 1.000e-03 | loss: 3.21 |
  kd loss: 2.10 | lm loss: 4.32 | grad norm: 0.812`` (``lm loss`` only when the loss forms it: alpha < 1; a blend's
  per-source figures ``kd loss [code]`` ... after them, those of the sources the step read);
- TensorBoard scalars through Bridge's own writer (``GlobalState.tensorboard_logger``: a ``SummaryWriter`` on the
  last rank when ``logger.tensorboard_dir`` is set), tags as Bridge's loop writes them (``learning-rate``,
  ``grad-norm``, the loss names), flushed at every logged line;
- the history on disk: ``<logger.tensorboard_dir>/history.jsonl``, one JSON row a step, written and flushed as
  the step ends, so a killed run keeps every step it finished. A resumed run keeps the rows before its
  checkpoint's step and appends; a run from step 0 starts the file anew. The rows are the returned history
  (bit-identical across runs of one seed); the throughput is in the line and the events only.
"""

from __future__ import annotations

import json
import pathlib

import torch.distributed as dist

HISTORY_FILE = "history.jsonl"
TENSORBOARD_TAGS = {"lr": "learning-rate", "grad norm": "grad-norm"}
"""History keys whose TensorBoard tag is Bridge's spelling; the others keep their names."""


def read_history(folder) -> list[dict]:
    """The rows of ``<folder>/history.jsonl`` (a tensorboard_dir), [] when there is none."""
    path = pathlib.Path(folder) / HISTORY_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class StepLog:
    """Log lines, TensorBoard events and the on-disk history of one CPU run (see the module docstring)."""

    def __init__(self, state, *, start_step: int, tokens_per_step: int, print_lines: bool = True):
        cfg = state.cfg
        self.interval = max(1, cfg.logger.log_interval or 1)
        self.total = cfg.train.train_iters
        self.global_batch = cfg.train.global_batch_size
        self.tokens_per_step = tokens_per_step
        self.rank0 = dist.get_rank() == 0
        self.print_lines = print_lines and self.rank0
        self.writer = state.tensorboard_logger            # Bridge's SummaryWriter, or None
        self.file = None
        self.pending_seconds, self.pending_steps = 0.0, 0
        if cfg.logger.tensorboard_dir and self.rank0:
            folder = pathlib.Path(cfg.logger.tensorboard_dir)
            folder.mkdir(parents=True, exist_ok=True)
            kept = [row for row in read_history(folder) if row["step"] < start_step]
            self.file = open(folder / HISTORY_FILE, "w")
            self.file.writelines(json.dumps(row) + "\n" for row in kept)
            self.file.flush()

    def step(self, row: dict, seconds: float) -> None:
        """Record one finished step (``row["step"]`` counts from 0) that took ``seconds``."""
        done = row["step"] + 1
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(TENSORBOARD_TAGS.get(key, key), value, done)
            self.writer.add_scalar("throughput/tokens_per_sec", self.tokens_per_step / max(seconds, 1e-9), done)
        self.pending_seconds += seconds
        self.pending_steps += 1
        if done % self.interval and done != self.total:
            return
        tokens_per_s = self.pending_steps * self.tokens_per_step / max(self.pending_seconds, 1e-9)
        self.pending_seconds, self.pending_steps = 0.0, 0
        if self.writer is not None:
            self.writer.flush()
        if self.print_lines:
            fields = [f"iteration {done:>6}/{self.total:>6}", f"consumed samples: {done * self.global_batch}",
                      f"tokens/s: {tokens_per_s:,.0f}", f"learning rate: {row['lr']:.3e}", f"loss: {row['loss']:.6g}"]
            fields += [f"{key}: {row[key]:.6g}" for key in row if key.startswith(("kd loss", "lm loss"))]
            fields.append(f"grad norm: {row['grad norm']:.4g}")
            print(" | ".join(fields), flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.flush()
