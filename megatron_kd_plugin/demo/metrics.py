"""Held-out quality of a language model next to its teacher, evaluated densely over the full vocabulary.

Per held-out token t with target y_t, student log-probs log q_t = log_softmax(z_t) and teacher
log-probs log p_t over the same (padded) vocabulary V:

    perplexity      = exp( mean_t  -log q_t[y_t] )
    KL(teacher‖s)   = mean_t  Σ_v p_t[v] (log p_t[v] - log q_t[v])                      (nats/token)
    ECE             = Σ_bins (n_bin / N) |accuracy_bin - confidence_bin|,  confidence = max_v q_t[v],
                      accuracy = [argmax_v q_t[v] == y_t], ``ECE_BINS`` equal-width bins on [0, 1]

With ``documents`` (the held-out document d_t of each target token, ``data.spread_windows``), each model's
metrics also hold its sums per document, what ``demo.bootstrap`` resamples:

    by_document = {"nll": [Σ_{t: d_t = d} -log q_t[y_t]]_d, "kl": [Σ_{t: d_t = d} KL_t]_d, "tokens": [#{t: d_t = d}]_d}

Shapes: tokens [N, S+1] (samples as ``data.token_windows`` cuts them), documents [N, S], logits [b, s, V].
"""

from __future__ import annotations

import dataclasses

import torch
from tqdm.auto import tqdm

from megatron_kd_plugin.demo.teacher_training import causal_inputs

ECE_BINS = 15


@dataclasses.dataclass(kw_only=True)
class _Sums:
    """Running sums for one model over the evaluated tokens."""

    nll: float = 0.0
    kl: float = 0.0
    tokens: int = 0
    bin_count: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(ECE_BINS, dtype=torch.float64))
    bin_conf: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(ECE_BINS, dtype=torch.float64))
    bin_correct: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(ECE_BINS, dtype=torch.float64))
    by_document: torch.Tensor | None = None
    """[3, D] float64 sums of nll, KL and tokens per document, when the evaluation has documents."""

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor, teacher_logprobs: torch.Tensor,
            documents: torch.Tensor | None) -> None:
        """logprobs, teacher_logprobs [T, V] float32; targets [T]; documents [T] or None."""
        nll = -logprobs.gather(1, targets[:, None]).double().squeeze(1)                # [T]
        kl = torch.sum(teacher_logprobs.exp() * (teacher_logprobs - logprobs), dim=1, dtype=torch.float64)  # [T]
        self.nll += nll.sum().item()
        self.kl += kl.sum().item()
        self.tokens += targets.numel()
        if documents is not None:
            self.by_document.index_add_(1, documents, torch.stack([nll, kl, torch.ones_like(nll)]))
        conf, pred = logprobs.max(dim=1)                                            # [T]
        conf = conf.exp().double()
        bins = torch.clamp((conf * ECE_BINS).long(), max=ECE_BINS - 1)
        self.bin_count += torch.bincount(bins, minlength=ECE_BINS).double()
        self.bin_conf += torch.bincount(bins, weights=conf, minlength=ECE_BINS)
        self.bin_correct += torch.bincount(bins, weights=(pred == targets).double(), minlength=ECE_BINS)

    def result(self) -> dict[str, float]:
        ece = torch.sum(torch.abs(self.bin_correct - self.bin_conf)).item() / self.tokens
        result = dict(perplexity=float(torch.tensor(self.nll / self.tokens).exp()), kl_to_teacher=self.kl / self.tokens,
                      ece=ece, tokens=self.tokens)
        if self.by_document is not None:
            result["by_document"] = dict(zip(("nll", "kl", "tokens"), self.by_document.tolist()))
        return result


def gpt_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] of a TP=1 megatron-core GPTModel for inputs ``tokens`` [b, s]."""
    return model(tokens, *causal_inputs(tokens))


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V] of a transformers causal LM (its own forward and causal mask) for ``tokens`` [b, s]."""
    return model(input_ids=tokens).logits


def full_logprobs(model: torch.nn.Module, tokens: torch.Tensor, logits_fn=gpt_logits) -> torch.Tensor:
    """Dense next-token log-probs for inputs ``tokens`` [b, s]; returns [b*s, V] float32."""
    return torch.log_softmax(logits_fn(model, tokens).float(), dim=-1).flatten(0, 1)


def unigram_perplexity(train_tokens: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Held-out perplexity of the train split's token frequencies (add-one smoothed over ``vocab_size`` ids): the
    baseline a language model must beat to have learnt anything beyond frequencies."""
    counts = torch.bincount(train_tokens.flatten(), minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(torch.exp(-logp[targets.flatten()].mean()))


@torch.no_grad()
def evaluate(models: dict[str, torch.nn.Module], teacher: torch.nn.Module, samples: torch.Tensor, *,
             documents: torch.Tensor | None = None, micro_batch_size: int = 8, desc: str = "evaluate",
             logits_fn=gpt_logits) -> dict[str, dict]:
    """Perplexity, KL(teacher‖model) and ECE of each model (and of the teacher, under "teacher"), and with
    ``documents`` their sums per document (``by_document``).

    All models run in eval mode, through ``logits_fn(model, inputs) -> [b, s, V]`` (``gpt_logits``: TP=1
    GPTModels; ``hf_logits``: transformers models); ``samples`` [N, S+1] int64, ``documents`` [N, S] int64.
    Returns {name: metrics}.
    """
    if samples.ndim != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must be [N, S+1] with S >= 1, got shape {tuple(samples.shape)}")
    if documents is not None and documents.shape != (samples.shape[0], samples.shape[1] - 1):
        raise ValueError(f"documents must be [N, S] = {(samples.shape[0], samples.shape[1] - 1)}, got shape "
                         f"{tuple(documents.shape)}")
    batches = ((batch[:, :-1], None, batch[:, 1:].reshape(-1),
                None if documents is None else documents[start:start + micro_batch_size].reshape(-1))
               for start in range(0, len(samples), micro_batch_size)
               for batch in [samples[start:start + micro_batch_size]])
    return _evaluate_batches(models, teacher, batches, total=-(-len(samples) // micro_batch_size),
                             documents=None if documents is None else int(documents.max()) + 1, desc=desc,
                             logits_fn=logits_fn)


@torch.no_grad()
def evaluate_masked_documents(models: dict[str, torch.nn.Module], teacher: torch.nn.Module,
                              tokens: list[torch.Tensor], targets: list[torch.Tensor], documents: list[int], *,
                              pad_id: int, micro_batch_size: int = 8, desc: str = "evaluate",
                              logits_fn=hf_logits) -> dict[str, dict]:
    """``evaluate``'s metrics over the target tokens of whole sequences, each evaluated alone as its own sequence
    (positions from 0, attending only to itself), e.g. conversations scored on their assistant tokens only.

    Sequence i is ``tokens[i]`` [L_i] int64; token t counts as a label (predicted at t - 1) where
    ``targets[i][t]`` is 1 (``targets[i]`` [L_i], 0/1; the first token is never one); ``documents[i]`` is what the
    bootstrap resamples it with (e.g. the file it came from). A micro-batch right-pads its sequences with ``pad_id``:
    under a causal mask a real token never sees the padding after it, so each row is its sequence alone.
    """
    if not len(tokens) == len(targets) == len(documents) or not tokens:
        raise ValueError(f"need as many targets and documents as sequences (>= 1), got {len(tokens)} sequences, "
                         f"{len(targets)} targets, {len(documents)} documents")
    for i, (ids, mask) in enumerate(zip(tokens, targets)):
        if ids.shape != mask.shape or len(ids) < 2 or mask[0]:
            raise ValueError(f"sequence {i}: needs >= 2 tokens, targets of the same shape and no target at token 0; "
                             f"got {tuple(ids.shape)} tokens, {tuple(mask.shape)} targets")

    def batches():
        for start in range(0, len(tokens), micro_batch_size):
            ids = torch.nn.utils.rnn.pad_sequence(tokens[start:start + micro_batch_size], batch_first=True,
                                                  padding_value=pad_id)                      # [b, L]
            keep = torch.nn.utils.rnn.pad_sequence(targets[start:start + micro_batch_size], batch_first=True,
                                                   padding_value=0)[:, 1:].bool()           # [b, L-1]
            owner = torch.tensor(documents[start:start + micro_batch_size])[:, None].expand_as(keep)
            yield ids[:, :-1], keep.reshape(-1), ids[:, 1:][keep], owner[keep]

    return _evaluate_batches(models, teacher, batches(), total=-(-len(tokens) // micro_batch_size),
                             documents=max(documents) + 1, desc=desc, logits_fn=logits_fn)


def _evaluate_batches(models: dict[str, torch.nn.Module], teacher: torch.nn.Module, batches, *, total: int,
                      documents: int | None, desc: str, logits_fn) -> dict[str, dict]:
    """The loop of ``evaluate``: each batch (inputs [b, s], keep [b*s] bool or None (every position), targets
    [T], documents [T] or None) through every model in eval mode; returns {name: metrics}."""
    everyone = {"teacher": teacher, **models}
    was_training = {name: m.training for name, m in everyone.items()}
    for m in everyone.values():
        m.eval()
    sums = {name: _Sums(by_document=None if documents is None else torch.zeros(3, documents, dtype=torch.float64))
            for name in everyone}
    for inputs, keep, targets, batch_documents in tqdm(batches, total=total, desc=desc, unit="batch"):
        def logprobs(model):
            full = full_logprobs(model, inputs, logits_fn)                                   # [b*s, V]
            return full if keep is None else full[keep]

        teacher_lp = logprobs(teacher)
        for name, model in everyone.items():
            sums[name].add(teacher_lp if model is teacher else logprobs(model), targets, teacher_lp, batch_documents)
    for name, m in everyone.items():
        m.train(was_training[name])
    return {name: s.result() for name, s in sums.items()}
