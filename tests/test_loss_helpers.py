"""Shared inputs, references and fixtures of the loss tests (no tests here; importable by spawned ranks)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_kd_plugin.loss import SampledTeacher, TopKTeacher, topk_kd_loss

COMBOS = [(tail, div) for tail, div in itertools.product(("ghost", "none", "renorm"),
                                                         ("forward_kl", "reverse_kl", "jsd"))
          if tail != "none" or div == "forward_kl"]


def make_case(*, s=3, b=47, hidden_size=31, vocab=123, k=7, dtype=torch.float64, seed=0, duplicates=True,
              padding=True, mask_sequence=True, teacher_vocab=None):
    """Random student and a teacher whose top-K log-probs are normalised over ``teacher_vocab`` (default vocab),
    with repeated ids, -inf padding slots and one fully masked sequence."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) / hidden_size ** 0.5 * 2
    teacher_vocab = vocab if teacher_vocab is None else teacher_vocab
    teacher = (torch.randn(s, b, teacher_vocab, generator=gen, dtype=torch.float64) * 2).log_softmax(-1)
    logprobs, ids = teacher.topk(k, dim=-1)
    perm = torch.randperm(k, generator=gen)                    # rank order must not matter
    ids, logprobs = ids[..., perm], logprobs[..., perm]
    if duplicates and k > 2:                                   # split one id's mass over two slots
        ids[:, ::3, 1] = ids[:, ::3, 0]
        half = logprobs[:, ::3, 0] - torch.log(torch.tensor(2.0, dtype=torch.float64))
        logprobs[:, ::3, 0] = half
        logprobs[:, ::3, 1] = half
    if padding and k > 2:                                      # drop a slot: -inf, probability 0
        logprobs[:, 1::4, k - 1] = -torch.inf
    loss_mask = (torch.rand(s, b, generator=gen) > 0.2).double()
    if mask_sequence:
        loss_mask[:, 2] = 0.0
    labels = torch.randint(0, vocab, (s, b), generator=gen)
    return dict(hidden=hidden.to(dtype), weight=weight.to(dtype), teacher_ids=ids.to(torch.int32),
                teacher_logprobs=logprobs, loss_mask=loss_mask, labels=labels)


def draw_from_teacher(teacher_logprobs: torch.Tensor, draws: int, proposal_temperature: float,
                      generator: torch.Generator):
    """Full teacher log-probs [..., V] -> ``draws`` ids per token drawn iid (with replacement) from the proposal
    q ∝ p^(1/t): (ids [..., N], their teacher log-probs l [..., N], importance weights w = p / (N q) [..., N])."""
    log_q = (teacher_logprobs / proposal_temperature).log_softmax(-1)
    flat = log_q.reshape(-1, log_q.shape[-1]).exp()
    ids = torch.multinomial(flat, draws, replacement=True, generator=generator).reshape(*log_q.shape[:-1], draws)
    logprobs = teacher_logprobs.gather(-1, ids)
    return ids, logprobs, (logprobs - log_q.gather(-1, ids)).exp() / draws


def make_sampled_case(*, draws=9, proposal_temperature=1.5, teacher_vocab=None, seed=0, **shape):
    """``make_case``'s student, mask and labels with a sampled teacher: ``draws`` ids per token drawn from a full
    teacher (repeats happen), their log-probs and importance weights ``draw_weights``; some slots are padding (-inf log-prob with a
    non-zero weight, which must be ignored)."""
    case = make_case(seed=seed, teacher_vocab=teacher_vocab, **shape)
    s, b = case["loss_mask"].shape
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = case["weight"].shape[0] if teacher_vocab is None else teacher_vocab
    teacher = (torch.randn(s, b, vocab, generator=gen, dtype=torch.float64) * 2).log_softmax(-1)
    ids, logprobs, weights = draw_from_teacher(teacher, draws, proposal_temperature, gen)
    logprobs[:, 1::4, -1] = -torch.inf
    return dict(case, teacher_ids=ids.to(torch.int32), teacher_logprobs=logprobs, draw_weights=weights)


def make_head_draws_case(*, head=3, draws=6, seed=0, **shape):
    """``make_case``'s student, mask and labels with a head + draws teacher (``cache.kinds.head_draws``): per token the
    exact top-``head`` of a full teacher, then ``draws`` ids drawn from the rest, weighed p and (1 - m) / N."""
    from megatron_kd_plugin.cache.kinds.draws import draw_uniforms
    from megatron_kd_plugin.cache.kinds.head_draws import head_draw_weights, vocab_parallel_head_draws

    case = make_case(seed=seed, **shape)
    s, b = case["loss_mask"].shape
    logits = torch.randn(s, b, case["weight"].shape[0], generator=torch.Generator().manual_seed(seed + 1)) * 2
    rows = vocab_parallel_head_draws(logits, draw_uniforms(seed, 0, b, s, draws), head)
    return dict(case, teacher_ids=rows.ids.to(torch.int32), teacher_logprobs=rows.logprobs.double(),
                draw_weights=head_draw_weights(rows.logprobs, head).double())


def teacher_of(case) -> TopKTeacher | SampledTeacher:
    """The case's teacher as the loss takes it: a ``SampledTeacher`` when the case has ``draw_weights``."""
    if "draw_weights" in case:
        return SampledTeacher(case["teacher_ids"], case["teacher_logprobs"], case["draw_weights"])
    return TopKTeacher(case["teacher_ids"], case["teacher_logprobs"])


def combo(options: dict, *, tail: str, divergence: str) -> dict:
    """``options`` for one tail x divergence: their ``jsd_beta`` only where the divergence is JSD (elsewhere the
    options refuse it: it would have no effect)."""
    kept = {name: value for name, value in options.items() if name != "jsd_beta" or divergence == "jsd"}
    return dict(kept, tail=tail, divergence=divergence)


def run_loss(case, *, hidden=None, weight=None, **options):
    """topk_kd_loss forward + backward of loss_sum (a sampled case's draws with their weights); returns (result,
    d_hidden, d_weight)."""
    hidden = (case["hidden"] if hidden is None else hidden).detach().clone().requires_grad_()
    weight = (case["weight"] if weight is None else weight).detach().clone().requires_grad_()
    labels = case["labels"] if options.pop("with_labels", False) else None
    result = topk_kd_loss(hidden, weight, teacher_of(case), loss_mask=case["loss_mask"], labels=labels, **options)
    result.loss_sum.backward()
    return result, hidden.grad, weight.grad


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (one number per tensor, robust to tiny entries)."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


@pytest.fixture(autouse=False)
def one_thread():
    """The loss tests run many tiny ops: one intra-op thread avoids OpenMP spin-waits on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_saturated_case(dtype=torch.float32):
    """2 x 5 tokens, H = V = 8, W = I. Tokens 0 and 3 have a teacher whose top-K mass is exactly 1 (log-prob 0 on one
    id, the other slot padding) and a student logit of 200 on that id, so the student's tail underflows to 0 in fp32
    (exp(-200 / tau) for tau < 2.3); the other tokens are ordinary. Issue 15, item 7."""
    gen = torch.Generator().manual_seed(7)
    s, b, v, k = 2, 5, 8, 2
    hidden = torch.randn(s, b, v, generator=gen, dtype=torch.float64) * 2
    logprobs, ids = (torch.randn(s, b, v, generator=gen, dtype=torch.float64) * 2).log_softmax(-1).topk(k, dim=-1)
    for token in (0, 3):
        row, col = divmod(token, b)
        hidden[row, col] = 0.0
        hidden[row, col, ids[row, col, 0]] = 200.0
        logprobs[row, col] = torch.tensor([0.0, -torch.inf], dtype=torch.float64)
    return dict(hidden=hidden.to(dtype), weight=torch.eye(v, dtype=dtype), teacher_ids=ids.to(torch.int32),
                teacher_logprobs=logprobs.to(dtype), loss_mask=torch.ones(s, b, dtype=torch.float64),
                labels=torch.randint(0, v, (s, b), generator=gen))


SATURATED_COMBOS = [("ghost", "forward_kl"), ("ghost", "jsd"), ("none", "forward_kl"), ("renorm", "forward_kl"),
                    ("renorm", "reverse_kl"), ("renorm", "jsd")]
"""Every tail x divergence whose float64 value is finite on ``make_saturated_case`` (ghost reverse KL is +inf in
exact arithmetic there: a zero teacher tail against a student tail that float64 still holds)."""


def make_small_tail_case(tail_mass: float):
    """4 x 50 tokens, V=64, K=4: slots 1-3 hold fp32-exact log-probs around -7.5, slot 0 the rest of 1 - tail_mass,
    rounded to fp32 (its rounding moves the tail by < 2e-10). Issue 15, item 8."""
    case = make_case(s=4, b=50, hidden_size=16, vocab=64, k=4, dtype=torch.float32, duplicates=False, padding=False,
                     mask_sequence=False)
    gen = torch.Generator().manual_seed(5)
    small = torch.tensor([-7.0, -7.5, -8.0, -8.5], dtype=torch.float64)[torch.randint(0, 4, (4, 50, 3),
                                                                                       generator=gen)]
    head = torch.log1p(-tail_mass - small.exp().sum(-1, keepdim=True))
    case["teacher_logprobs"] = torch.cat([head, small], -1).float()
    true_tail = 1.0 - case["teacher_logprobs"].double().exp().sum(-1)
    assert (true_tail - tail_mass).abs().max() < 0.2 * tail_mass
    return case


def make_ragged_case(*, s=3, b=5, hidden_size=9, vocab=37, k=8, seed=0, teacher_vocab=None):
    """``make_case``'s student, mask and labels with a top-p teacher's ragged rows, laid out as a top-p store holds
    them (``cache/writer.py``): per token its kept ids ascending after K - kept padding slots (id 0, log-prob -inf).
    Kept counts run from 1 to K (every count appears); on the first tokens the teacher's top id is 0, so a kept id
    0 shares its id with the padding."""
    case = make_case(s=s, b=b, hidden_size=hidden_size, vocab=vocab, k=k, seed=seed, duplicates=False,
                     padding=False, teacher_vocab=teacher_vocab)
    gen = torch.Generator().manual_seed(seed + 2)
    teacher = (torch.randn(s, b, teacher_vocab or vocab, generator=gen, dtype=torch.float64) * 2)
    teacher[:, :2, 0] += 6.0                                   # id 0 kept (and ranked first) on tokens 0-1 of each row
    logprobs, ids = teacher.log_softmax(-1).topk(k, dim=-1)   # [s, b, K] rank order
    kept = torch.arange(s * b).reshape(s, b) % k + 1           # [s, b] 1..K
    keep = torch.arange(k) < kept[..., None]
    ids = torch.where(keep, ids, -1).sort(dim=-1, stable=True)
    logprobs = torch.where(keep, logprobs, -torch.inf).gather(-1, ids.indices)
    return dict(case, teacher_ids=ids.values.clamp(min=0).to(torch.int32), teacher_logprobs=logprobs)


def token_kd_from_definition(z: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, tail: str, divergence: str,
                             tau: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's (KD term, student mass on the support) from the definitions, z [V] the student's raw logits
    (differentiable). The teacher's finite slots are its support (repeated ids add up; padding carries nothing).
    ghost: over the FULL vocab, the teacher's unknown tail filled with the student's tail shape at tau = 1
    (stop-gradient) and both sides tempered, P_j ∝ p_j^(1/tau) on S, ((1 - m) q1_j / sum_tail q1)^(1/tau) off S;
    none: P = m softmax_K(l / tau) against q on S; renorm: both renormalised over S."""
    p = {}
    for i, logprob in zip(ids.tolist(), logprobs.tolist(), strict=True):
        if logprob > -math.inf:
            p[i] = p.get(i, 0.0) + math.exp(logprob)
    support = sorted(p)
    q = torch.softmax(z / tau, -1)
    p_s = torch.tensor([p[i] for i in support], dtype=torch.float64)
    q_s = q[support]
    m = p_s.sum()
    if tail == "ghost":
        q1 = torch.softmax(z.detach(), -1)
        off = torch.ones(len(z), dtype=torch.bool)
        off[support] = False
        P = torch.zeros_like(q1)
        P[support] = p_s ** (1 / tau)
        P[off] = ((1 - m) * q1[off] / q1[off].sum()) ** (1 / tau)
        P, Q = P / P.sum(), q
    elif tail == "none":
        P, Q = m * torch.softmax(p_s.log() / tau, -1), q_s
    else:
        P, Q = torch.softmax(p_s.log() / tau, -1), q_s / q_s.sum()
    kl = lambda a, c: (a * (a / c).log()).sum()                # noqa: E731
    if divergence == "forward_kl":
        return kl(P, Q), q_s.sum()
    if divergence == "reverse_kl":
        return kl(Q, P), q_s.sum()
    M = beta * P + (1 - beta) * Q
    return beta * kl(P, M) + (1 - beta) * kl(Q, M), q_s.sum()
