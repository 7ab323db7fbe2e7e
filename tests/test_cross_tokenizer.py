"""Cross-tokenizer distillation (issue #18) against float64 references written here: the store's new arrays, the
segment alignment of two real tokenizers trained in-test (byte-level BPE and Unigram, both directions), the ALM segment
loss and its gradients at TP=1 and TP=2 (one spawn), and the one-line refusals."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import pathlib
import pickle

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.cross_tokenizer.align import (TeacherTopK, align_sample, alignment_row, byte_ends,
                                                            student_ends, valid_text)
from megatron_kd_plugin.cache.cross_tokenizer.first_tokens import FirstTokens
from megatron_kd_plugin.cache.cross_tokenizer.token_slots import token_slots
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows
from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes, check_lossless
from megatron_kd_plugin.cache.writer import write_cache
from megatron_kd_plugin.loss import CrossTokenizerTeacher, cross_tokenizer_loss, tensor_map
from megatron_kd_plugin.loss.cross_tokenizer_loss import token_teacher
from tests.distributed import run_on_ranks

TEXTS = [
    "The internationalization of tokenizers is a notoriously unglamorous problem. ",
    "Schöne Grüße aus München: Straße, Fußgänger, Äpfel und Öl. ",
    "日本語のテキストと絵文字 🦊🦊 が混ざった文章です。 ",
    "Numbers 12345 + 678 = 13023; internationalization again, and again, and again. ",
    "Déjà vu: naïve café owners résumé their façade. ",
] * 6
V_TEACHER = 420
SPECIAL_IDS = {0}                            # the teacher BPE's <|endoftext|>


def train_bpe(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def train_unigram(vocab_size: int, lowercase: bool = False) -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXTS, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<unk>"],
                                                           unk_token="<unk>", max_piece_length=4))
    return tok


@pytest.fixture(scope="module")
def tokenizers_pair():
    """(byte-level BPE with long merges, Unigram with short pieces) as TokenBytes."""
    return (TokenBytes.from_tokenizer(train_bpe(V_TEACHER), identity="bpe"),
            TokenBytes.from_tokenizer(train_unigram(300), identity="unigram"))


@pytest.fixture(scope="module")
def byte_fallback_student():
    """A SentencePiece-style Unigram with byte fallback (Llama 2's kind): its pieces trained on the texts without
    Japanese and emoji, plus the 256 ``<0xNN>`` pieces, so those characters are spelt byte by byte."""
    latin = Tokenizer(models.Unigram())
    latin.pre_tokenizer = pre_tokenizers.Metaspace()
    latin.train_from_iterator([t for t in TEXTS if "日" not in t],
                              trainers.UnigramTrainer(vocab_size=250, special_tokens=["<unk>"], unk_token="<unk>"))
    trained = json.loads(latin.to_str())["model"]
    pieces = [tuple(piece) for piece in trained["vocab"]] + [(f"<0x{b:02X}>", -30.0) for b in range(256)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=trained["unk_id"], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return TokenBytes.from_tokenizer(tok, identity="unigram+bytes")


@pytest.fixture(scope="module")
def unigram_eos_student():
    """A Unigram (SentencePiece-style) student with <|endoftext|> as a special token: it inserts "▁" after it."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(TEXTS, trainers.UnigramTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
                                                           unk_token="<unk>"))
    return TokenBytes.from_tokenizer(tok, identity="unigram+eos")


# ---- float64 references -------------------------------------------------------------------------------------------

def cross_tokenizer_row(tokens, realised_logprobs, teacher, student, seq_length, *, topk=None, mid_candidates=None):
    """The student row of one cached sample: teacher ``tokens`` [S + 1], ``realised_logprobs`` [S]; ``topk``: the
    cached (ids, logprobs) [S, K] for the token-level term (both steps of ``cache.cross_tokenizer.align``); from source
    0, as ``KDRows`` marks it (a DataLoader's collate takes no None)."""
    return _row(tokens, realised_logprobs, teacher, student, seq_length, topk, mid_candidates)._replace(
        source=torch.tensor(0))


def _row(tokens, realised_logprobs, teacher, student, seq_length, topk, mid_candidates):
    if topk is None:
        return alignment_row(align_sample(tokens, teacher, student), realised_logprobs, seq_length)
    table = FirstTokens.compute(teacher, student)
    cached = TeacherTopK(np.asarray(topk[0]), np.asarray(topk[1]), np.asarray(realised_logprobs))
    alignment = align_sample(tokens, teacher, student, topk=cached, table=table)
    if mid_candidates is not None:                               # the same sample with fewer candidates kept
        teacher_ends, ids, ends, _ = byte_ends(tokens, teacher, student)
        alignment = dataclasses.replace(alignment, slots=token_slots(
            np.asarray(tokens), teacher_ends, ids, ends, cached.ids, cached.logprobs, cached.realised, teacher, table,
            mid_candidates=mid_candidates))
    return alignment_row(alignment, realised_logprobs, seq_length, cached, table.vocab_map)


def reference_segments(teacher_lengths: list[int], student_lengths: list[int]) -> list[tuple[list[int], list[int]]]:
    """Two pointers over the byte lengths: a segment closes whenever both sides have consumed the same bytes."""
    segments, i, j, tb, sb = [], 0, 0, 0, 0
    current = ([], [])
    while i < len(teacher_lengths) or j < len(student_lengths):
        if j >= len(student_lengths) or (i < len(teacher_lengths) and tb <= sb):
            tb += teacher_lengths[i]
            current[0].append(i)
            i += 1
        else:
            sb += student_lengths[j]
            current[1].append(j)
            j += 1
        if tb == sb and current[0] and current[1]:
            segments.append(current)
            current = ([], [])
    return segments


def reference_row(tokens, logprobs, teacher: TokenBytes, student: TokenBytes, seq_length: int):
    """(segment of each label position [seq_length], teacher sum per segment) from ``reference_segments``."""
    text = b"".join(teacher.strings[t] for t in tokens)
    lead = 0
    while lead < 3 and 0x80 <= text[lead] < 0xC0:
        lead += 1
    body = text[lead:]
    for end in range(len(body), -1, -1):                  # the longest valid UTF-8 prefix
        try:
            chars = body[:end].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    ids = student.encode(chars)
    lengths = [len(student.strings[i]) for i in ids]
    if b"".join(student.strings[i] for i in ids) == b" " + chars.encode() and not chars.startswith(" "):
        lengths[0] -= 1                                   # the SentencePiece dummy prefix
    # the lead bytes as one pseudo student token (index -1): they join the first segment, which is dropped
    segments = reference_segments([len(teacher.strings[t]) for t in tokens], [lead] + lengths)
    segments = [(t, [j - 1 for j in s]) for t, s in segments]
    positions = np.full(seq_length, -1)
    sums = []
    for t_ids, s_ids in segments[1:]:
        if max(s_ids) > seq_length:
            break
        for j in s_ids:
            positions[j - 1] = len(sums)
        sums.append(math.fsum(float(logprobs[i - 1]) for i in t_ids))
    return positions, sums, ids


def mid_text_encoder(student: TokenBytes) -> Tokenizer:
    """The student's tokenizer without the space a Metaspace pre-tokenizer prepends (set through the Python API)."""
    tok = Tokenizer.from_str(student.tokenizer.to_str())
    if isinstance(tok.pre_tokenizer, pre_tokenizers.Metaspace):
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    return tok


def reference_first_token(u: bytes, student: TokenBytes, encoder: Tokenizer):
    """The student's first token of the byte string ``u`` (``cache.cross_tokenizer.first_tokens``' rule, written out),
    None if none."""
    if not u:
        return None
    for end in range(len(u), 0, -1):
        try:
            text = u[:end].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    else:                                                       # u starts inside a character: the longest prefix
        matches = [(len(string), -i) for i, string in enumerate(student.strings) if string and u.startswith(string)]
        return -max(matches)[1] if matches else None
    first = encoder.encode(text, add_special_tokens=False).ids[0]
    return first if student.strings[first] and u.startswith(student.strings[first]) else None


def reference_targets(tokens, topk_ids, topk_logprobs, realised, teacher: TokenBytes, student: TokenBytes, m: int,
                      mid_candidates: int = 16, seen=None):
    """[{student id: P}] of row positions 0..m-1 (None where not covered): the token-level term's definition
    (``loss.cross_tokenizer_loss``) written out with python loops over the bytes; ``seen`` counts the edge cases."""
    encoder = mid_text_encoder(student)
    text = b"".join(teacher.strings[t] for t in tokens)
    lead, chars = valid_text(text)
    ids = student.encode(chars)
    lengths, error = reference_drop_spaces([student.strings[i] for i in ids], chars.encode())   # inserted spaces
    assert error is None
    ends = list(itertools.accumulate(lengths, initial=lead))[1:]          # b_j
    teacher_ends = list(itertools.accumulate(len(teacher.strings[t]) for t in tokens))   # e_i
    seen = seen if seen is not None else collections.Counter()
    targets = []
    for p in range(m):
        u = max((i for i, e in enumerate(teacher_ends) if e <= ends[p]), default=None)
        if u is None or u >= len(tokens) - 1:
            targets.append(None)
            continue
        o, x, y = ends[p] - teacher_ends[u], int(tokens[u + 1]), ids[p + 1]
        prefix = teacher.strings[x][:o]
        candidates = list(zip(topk_ids[u].tolist(), topk_logprobs[u].tolist()))
        if x not in topk_ids[u].tolist():
            candidates.append((x, float(realised[u])))
        consistent = [(v, lp) for v, lp in candidates if teacher.strings[v].startswith(prefix) and lp > -math.inf]
        reached = [(y if v == x else reference_first_token(teacher.strings[v][o:], student, encoder), lp, v == x)
                   for v, lp in consistent]
        reached = [r for r in reached if r[0] is not None]
        z = 1.0 if o == 0 else math.fsum(math.exp(lp) for _, lp in consistent)
        if o > 0:
            reached = sorted(reached, key=lambda r: (not r[2], -r[1]))[:mid_candidates]
        target = collections.defaultdict(float)
        for w, lp, _ in reached:
            target[w] += math.exp(lp) / z
        targets.append(dict(target) if target else None)
        strings = [teacher.strings[v] for v, _ in consistent]
        seen["boundary" if o == 0 else "inside a token"] += 1
        seen["a prefix candidate"] += any(a != b and b.startswith(a) for a in strings for b in strings)
        seen["no candidate but the realised one"] += len(reached) == 1 and reached[0][2]
        seen["truncated"] += o > 0 and len(reached) == mid_candidates < len([r for r in consistent])
        seen["a special token"] += any(v in SPECIAL_IDS for v, _ in consistent)
        seen["a candidate starting inside a character"] += any(s[:1] and 0x80 <= s[0] < 0xC0 for s in strings)
    return targets


def implementation_targets(row) -> list:
    """[{student id: P}] of a row's positions from the loss's ``token_teacher`` (repeated ids summed)."""
    expanded = token_teacher(tensor_map(lambda t: t[:, None], row.teacher), row.labels[:, None])
    targets = []
    for ids, logprobs in zip(expanded.ids[:, 0].tolist(), expanded.logprobs[:, 0].double().tolist()):
        target = collections.defaultdict(float)
        for w, lp in zip(ids, logprobs):
            if lp > -math.inf:
                target[w] += math.exp(lp)
        targets.append(dict(target) if target else None)
    return targets


def assert_same_targets(got: list, expected: list, where) -> None:
    assert len(got) >= len(expected)
    for p, (a, b) in enumerate(zip(got, expected)):
        assert (a is None) == (b is None), (where, p, a, b)
        if a is not None:
            assert sorted(a) == sorted(b), (where, p, a, b)
            np.testing.assert_allclose([a[w] for w in sorted(a)], [b[w] for w in sorted(b)], rtol=2e-5, atol=1e-7)
    assert all(t is None for t in got[len(expected):])


def reference_loss(hidden, weight, *args, **kwargs):
    """float64 dense ALM from hidden [s, b, H] and the full lm_head [V, H]."""
    return reference_from_logits(hidden.double() @ weight.double().t(), *args, **kwargs)


def reference_token_term(logits, teacher_ids, teacher_logprobs, mask, divergence):
    """float64 sum_t w_t f_t of the token-level term: per token with a finite slot, the teacher's mapped ids (repeats
    merged) and the rest of its mass as one bucket (empty when none is left) against the student's softmax, the
    divergence written out."""
    q_all = torch.softmax(logits.double(), -1)                                          # [s, b, V]
    total = q_all.new_zeros(())
    for pos in range(logits.shape[0]):
        for col in range(logits.shape[1]):
            probs = {}
            for v, lp in zip(teacher_ids[pos, col].tolist(), teacher_logprobs[pos, col].double().tolist()):
                if lp > -math.inf:
                    probs[v] = probs.get(v, 0.0) + math.exp(lp)
            if not probs or mask[pos, col] == 0:
                continue
            ids = sorted(probs)
            p = torch.tensor([probs[v] for v in ids] + [max(0.0, 1.0 - sum(probs.values()))], dtype=torch.float64)
            q_ids = q_all[pos, col, ids]
            q = torch.cat([q_ids, (1.0 - q_ids.sum())[None]])
            f = (torch.xlogy(p, p) - p * q.log()).sum() if divergence == "forward_kl" else \
                (q * (q.log() - p.log())).sum()
            total = total + float(mask[pos, col]) * f
    return total


def reference_from_logits(logits, labels, segment_ids, teacher_segments, mask, *, divergence, temperature, alpha,
                          token_weight=0.0, teacher_ids=None, teacher_logprobs=None):
    """float64 dense ALM (plus the token-level term): full logits [s, b, V], per-segment python loops, the binarised
    divergence written out; each token's CE weighted by 1 - alpha * (the share of the teacher terms covering it)."""
    s, b, _ = logits.shape
    logp = torch.log_softmax(logits.double(), -1)                                      # [s, b, V]
    l = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (mask != 0)      # [s, b]
    in_used_segment = torch.zeros(s, b, dtype=torch.bool)
    segment = logp.new_zeros(())
    for col in range(b):
        for c in sorted(set(segment_ids[:, col].tolist()) - {-1}):
            members = (segment_ids[:, col] == c).nonzero().flatten()
            if bool((mask[members, col] == 0).any()):
                continue
            in_used_segment[members, col] = True
            lt = (teacher_segments[c, col].double() / temperature).clamp(max=-1e-6)
            ls = (l[members, col].sum() / temperature).clamp(max=-1e-6)
            p, q = lt.exp(), ls.exp()
            if divergence == "forward_kl":
                d = p * (lt - ls) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
            else:
                d = q * (ls - lt) + (1 - q) * (torch.log1p(-q) - torch.log1p(-p))
            segment = segment + len(members) * d
    coverage = (1 - token_weight) * in_used_segment.double()
    token = logp.new_zeros(())
    if token_weight:
        token = reference_token_term(logits, teacher_ids, teacher_logprobs, mask, divergence)
        coverage = coverage + token_weight * (torch.isfinite(teacher_logprobs).any(-1) & (mask != 0)).double()
    ce = -(mask.double() * (1 - alpha * coverage) * l).sum()
    return alpha * ((1 - token_weight) * segment + token_weight * token) + ce


# ---- tokenizers and alignment -------------------------------------------------------------------------------------

def test_byte_tables_are_lossless_and_wordpiece_or_normalising_tokenizers_are_refused(tokenizers_pair):
    for table in tokenizers_pair:
        check_lossless(table, TEXTS[:5])
    lowercase = TokenBytes.from_tokenizer(train_unigram(150, lowercase=True), identity="lower")
    with pytest.raises(ValueError, match="not lossless on text 0"):
        check_lossless(lowercase, TEXTS[:1])
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.train_from_iterator(TEXTS, trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]"]))
    with pytest.raises(ValueError, match="WordPiece"):
        TokenBytes.from_tokenizer(wordpiece)


@pytest.mark.parametrize("direction", ["bpe->unigram", "unigram->bpe"])
def test_rows_match_the_two_pointer_reference_in_both_directions(tokenizers_pair, direction):
    teacher, student = tokenizers_pair if direction == "bpe->unigram" else tokenizers_pair[::-1]
    stream = np.asarray(sum((teacher.encode(t) for t in TEXTS), []))
    rng = np.random.default_rng(0)
    one_to_many = many_to_one = 0
    for start in rng.integers(0, len(stream) - 41, 12).tolist() + [0]:   # arbitrary starts: mid-word, mid-char
        tokens = stream[start:start + 41]
        logprobs = -rng.random(40) * 5
        for seq_length in (8, 64):
            row = cross_tokenizer_row(tokens, logprobs, teacher, student, seq_length)
            positions, sums, ids = reference_row(tokens.tolist(), logprobs, teacher, student, seq_length)
            assert row.teacher.segment_ids.tolist() == positions.tolist()
            np.testing.assert_allclose(row.teacher.segment_logprobs[:len(sums)].numpy(), sums, rtol=1e-6)
            m = int(row.loss_mask.sum())
            assert row.tokens[:m].tolist() == ids[:m] and row.labels[:m].tolist() == ids[1:m + 1]
            assert m <= seq_length and (positions[m:] == -1).all()
        for t_ids, s_ids in reference_segments([len(teacher.strings[t]) for t in tokens],
                                             [len(student.strings[i]) for i in
                                              student.encode(valid_text(b"".join(teacher.strings[t]
                                                                                 for t in tokens))[1])]):
            one_to_many += len(t_ids) == 1 and len(s_ids) > 1
            many_to_one += len(t_ids) > 1 and len(s_ids) == 1
    assert one_to_many and many_to_one                     # both shapes of segment occur


def synthetic_topk(tokens, teacher: TokenBytes, unmapped: np.ndarray, rng, k: int = 5):
    """A cached top-K [S, K] of distinct ids for the token-level tests: random ids, the realised token among them at
    two positions in three, the teacher's special token and the longest proper prefix of the realised token's string
    that is a teacher token; at one position in six only ids in ``unmapped`` (no student first token) and not the
    realised one. Log-probs: Dirichlet(1) over K + 1 (the last the tail); the realised token's: its top-K one, else
    a part of the tail. Returns (ids, log-probs [S, K], realised log-probs [S])."""
    by_string = {string: v for v, string in enumerate(teacher.strings) if string}
    rows = []
    for t, x in enumerate(tokens[1:].tolist()):
        string = teacher.strings[x]
        prefix = next((by_string[string[:n]] for n in range(len(string) - 1, 0, -1) if string[:n] in by_string), None)
        if len(unmapped) >= k and rng.random() < 1 / 6:
            row = list(rng.choice(unmapped[unmapped != x], k, replace=False))
        else:
            row = ([x] if rng.random() < 2 / 3 else []) + [v for v in (*SPECIAL_IDS, prefix) if v is not None]
            while len(set(row)) < k:
                row.append(int(rng.integers(0, len(teacher.strings))))
            row = list(dict.fromkeys(row))[:k]
        rows.append(row)
    probs = rng.dirichlet(np.ones(k + 1), len(rows))                     # [S, K + 1]: the top-K and the tail
    ids = np.asarray(rows, dtype=np.int32)
    hit = ids == tokens[1:, None]
    realised = np.where(hit.any(1), (probs[:, :k] * hit).sum(1), probs[:, k] * rng.random(len(rows)))
    return ids, np.log(probs[:, :k]), np.log(realised)


TOKEN_DIRECTIONS = ["bpe->unigram", "unigram->bpe", "bpe->byte-fallback unigram"]


@pytest.mark.parametrize("direction", TOKEN_DIRECTIONS)
def test_token_slots_equal_the_definition_written_out(tokenizers_pair, unigram_eos_student, byte_fallback_student,
                                                      direction):
    """The token-level term's teacher at every student position (the rows' slots expanded by the loss's
    ``token_teacher``) equals the definition written out over the bytes (``reference_targets``): boundary positions
    and positions inside a teacher token, candidates that are prefixes of others, the teacher's special token,
    candidates starting inside a UTF-8 character (mapped to byte-fallback pieces), positions where only the realised
    candidate reaches a student token, and fewer candidates kept inside a token (``mid_candidates=1``)."""
    bpe, unigram = tokenizers_pair                  # a text with <|endoftext|>: a student that can spell it
    teacher, student = {"bpe->unigram": (bpe, unigram_eos_student), "unigram->bpe": (unigram, bpe),
                        "bpe->byte-fallback unigram": (bpe, byte_fallback_student)}[direction]
    eos = [0] if teacher.strings[0] == b"<|endoftext|>" else []
    stream = np.asarray(sum((teacher.encode(t) + eos for t in TEXTS), []))
    unmapped = np.flatnonzero(FirstTokens.compute(teacher, student).vocab_map < 0).astype(np.int32)
    rng = np.random.default_rng(1)
    seen = collections.Counter()
    for start in rng.integers(0, len(stream) - 41, 8).tolist():
        tokens = stream[start:start + 41]
        *topk, realised = synthetic_topk(tokens, teacher, unmapped, rng)
        for seq_length, mid_candidates in ((8, 16), (64, 16), (64, 1)):
            row = cross_tokenizer_row(tokens, realised, teacher, student, seq_length, topk=topk,
                                      mid_candidates=mid_candidates if mid_candidates != 16 else None)
            m = int(row.loss_mask.sum())
            expected = reference_targets(tokens, *topk, realised, teacher, student, m, mid_candidates, seen)
            got = implementation_targets(row)
            assert_same_targets(got, expected, (direction, start, seq_length, mid_candidates))
            seen["a byte piece reached"] += sum(any(len(student.strings[w]) == 1 and student.strings[w][0] >= 0x80
                                                    for w in target) for target in got if target)
    assert seen["boundary"] and seen["inside a token"] and seen["a prefix candidate"] and seen["truncated"], seen
    assert seen["no candidate but the realised one"], seen
    if direction != "unigram->bpe":
        assert seen["a special token"] and seen["a candidate starting inside a character"], seen
    if direction == "bpe->byte-fallback unigram":
        assert seen["a byte piece reached"], seen


def test_the_teachers_special_token_reaches_the_students_special_token_or_its_text(tokenizers_pair,
                                                                                  unigram_eos_student,
                                                                                  byte_fallback_student):
    """A teacher's special token is its content: the student's special token of the same content, else the first
    token of that text (a byte-fallback piece for "<"), else nothing (a student that cannot spell it); a character's
    tail reaches nothing for a student without byte fallback."""
    bpe, unigram = tokenizers_pair
    with_eos = FirstTokens.compute(bpe, unigram_eos_student).vocab_map
    spelt = FirstTokens.compute(bpe, byte_fallback_student).vocab_map
    without = FirstTokens.compute(bpe, unigram).vocab_map
    assert bpe.strings[0] == b"<|endoftext|>" and unigram_eos_student.strings[with_eos[0]] == b"<|endoftext|>"
    assert byte_fallback_student.strings[spelt[0]] == b"<" and without[0] == -1
    tails = [v for v, string in enumerate(bpe.strings) if string[:1] and 0x80 <= string[0] < 0xC0]
    assert tails and (without[tails] == -1).all() and (spelt[tails] >= 0).all()


def test_a_window_starting_inside_a_multibyte_character_is_aligned_after_it(tokenizers_pair):
    teacher, student = tokenizers_pair
    ids = teacher.encode("日本語のテキスト")
    split = next(i for i, t in enumerate(ids) if teacher.strings[t][:1] and 0x80 <= teacher.strings[t][0] < 0xC0)
    tokens = np.asarray(ids[split:] + teacher.encode(" and again"))     # starts with a continuation byte
    u, chars = valid_text(b"".join(teacher.strings[t] for t in tokens))
    assert u >= 1 and not chars.startswith("日")
    row = cross_tokenizer_row(tokens, -np.ones(len(tokens) - 1), teacher, student, 64)
    positions, sums, _ = reference_row(tokens.tolist(), -np.ones(len(tokens) - 1), teacher, student, 64)
    assert row.teacher.segment_ids.tolist() == positions.tolist() and len(sums) >= 2


def test_spaces_a_sentencepiece_student_inserts_after_special_tokens_are_dropped(unigram_eos_student):
    student = unigram_eos_student
    text = "and again<|endoftext|>Numbers again"
    ids = np.asarray(student.encode(text))
    assert student.concat(ids).tobytes() != text.encode()       # the tokenizer inserts "▁" after the special token
    ends = student_ends(student, ids, text, "test")
    assert ends[-1] == len(text.encode())
    pieces = [text.encode()[a:b] for a, b in zip(np.r_[0, ends[:-1]], ends)]
    assert b"".join(pieces) == text.encode() and b"<|endoftext|>" in pieces      # the inserted "▁" became b""
    with pytest.raises(ValueError, match="disagree at byte 9"):
        student_ends(student, ids, "and againX|endoftext|>Numbers again", "test")


def reference_drop_spaces(pieces: list[bytes], want: bytes) -> tuple[list[int], int | None]:
    """Token by token: keep a piece matching where it stands, else drop its leading space if that makes it match,
    else fail at its start (lengths, None) / (lengths, failing byte)."""
    lengths, position = [len(p) for p in pieces], 0
    for j, piece in enumerate(pieces):
        if want.startswith(piece, position):
            position += len(piece)
        elif piece[:1] == b" " and want.startswith(piece[1:], position):
            lengths[j] -= 1
            position += len(piece) - 1
        else:
            return lengths, position
    return lengths, None if position == len(want) else position


def test_inserted_spaces_are_dropped_as_the_token_by_token_reference_does(unigram_eos_student):
    student = unigram_eos_student
    rng = np.random.default_rng(3)
    words = " ".join(TEXTS[:5]).split(" ")
    checked = {"dropped": 0, "error": 0}
    for case in range(40):
        parts = [" ".join(rng.choice(words, int(rng.integers(1, 6)))) for _ in range(int(rng.integers(1, 5)))]
        text = "<|endoftext|>".join((" " if rng.random() < 0.3 else "") + p for p in parts)
        ids = np.asarray(student.encode(text))
        want = text.encode()
        if case % 4 == 3:                                       # a text the tokens do not spell: an error somewhere
            at = int(rng.choice([i for i, byte in enumerate(want) if byte < 0x80]))          # stays valid UTF-8
            want = want[:at] + (b"#" if want[at:at + 1] != b"#" else b"%") + want[at + 1:]
        expected, error = reference_drop_spaces([student.strings[i] for i in ids], want)
        if error is None:
            assert student_ends(student, ids, want.decode(), "t").tolist() == np.cumsum(expected).tolist()
            checked["dropped"] += sum(len(student.strings[i]) for i in ids) > len(want)
        else:
            with pytest.raises(ValueError, match=f"disagree at byte {error}:"):
                student_ends(student, ids, want.decode(), "t")
            checked["error"] += 1
    assert checked["dropped"] and checked["error"]


def test_encode_is_the_tokenizers_own(tokenizers_pair):
    for table in tokenizers_pair:
        assert [table.encode(t) for t in TEXTS[:5]] == [table.tokenizer.encode(t, add_special_tokens=False).ids
                                                        for t in TEXTS[:5]]
        assert table.encode_batch(TEXTS[:5]) == [table.encode(t) for t in TEXTS[:5]]


def test_tokenizer_transfer_starts_each_new_row_from_the_old_rows_that_spell_it(tokenizers_pair):
    """The transferred student's embedding row of a B token is the mean of the teacher's rows of the A tokens that
    spell its string, its output row the first one's; B ids A cannot spell take the mean rows."""
    from megatron_kd_plugin.demo.tokenizer_transfer import EMBEDDING, OUTPUT, spellings, transferred_state

    a, b = tokenizers_pair
    g = torch.Generator().manual_seed(0)
    state = {EMBEDDING: torch.randn(len(a.strings), 5, generator=g), OUTPUT: torch.randn(len(a.strings), 5, generator=g),
             "other": torch.ones(2)}
    new = transferred_state(state, a, b, len(b.strings) + 3)
    assert new["other"] is state["other"] and new[EMBEDDING].shape == (len(b.strings) + 3, 5)
    kinds = collections.Counter()
    for token, ids in enumerate(spellings(a, b)):
        if ids:
            assert b"".join(a.strings[i] for i in ids) == b.strings[token]
            torch.testing.assert_close(new[EMBEDDING][token], state[EMBEDDING][ids].mean(0))
            torch.testing.assert_close(new[OUTPUT][token], state[OUTPUT][ids[0]])
        kinds["one" if len(ids) == 1 else "several" if ids else "none"] += 1
    torch.testing.assert_close(new[EMBEDDING][-1], state[EMBEDDING].mean(0))
    assert kinds["one"] and kinds["several"], kinds


# ---- store and dataset --------------------------------------------------------------------------------------------

def small_store(path, teacher: TokenBytes, *, n: int = 8, seq: int = 24, fingerprint: str = "xtok"):
    """A cross-tokenizer store of ``n`` samples of the TEXTS stream, teacher = a random bigram table; the table."""
    stream = np.asarray(sum((teacher.encode(t) for t in TEXTS), []))
    table = 3 * torch.randn(V_TEACHER, V_TEACHER, generator=torch.Generator().manual_seed(0))
    source = TokenWindows(stream, seq, num_samples=n, fingerprint=fingerprint, tokenizer="bpe",
                          tokenizer_vocab_size=V_TEACHER)
    write_cache(source, lambda tokens, position_ids=None: table[tokens].transpose(0, 1), path, k=4, vocab_size=V_TEACHER,
                teacher="table", samples_per_shard=4, logprob_codec="fp32", progress=False,
                vocab_table=TokenBytes.from_tokenizer(teacher.tokenizer, vocab_size=V_TEACHER))
    return table


def test_store_holds_realised_logprobs_and_byte_table_and_rows_follow(tmp_path, tokenizers_pair):
    from megatron_kd_plugin.cache import KDRows, row_kind

    teacher, student = tokenizers_pair
    n, path = 8, tmp_path / "cache.zarr"
    table = small_store(path, teacher, n=n)
    reader = TopKCacheReader(path)
    assert reader.vocab_table().strings == teacher.strings
    logp = torch.log_softmax(table.double(), -1)
    for i in range(n):
        row = reader[i]
        tokens = row.tokens
        expected = logp[tokens[:-1], tokens[1:]]                          # the realised token, in the top-K or not
        torch.testing.assert_close(row.realised_logprob.double(), expected, rtol=0, atol=1e-5)
    data = KDRows(row_kind(reader, seq_length=16, student=student, alignments="memory"), np.arange(n), num_rows=n,
                  seed=0, shuffle=False)
    for i in range(n):
        item, cached = data[i], reader[i]
        positions, sums, _ = reference_row(cached.tokens.tolist(), cached.realised_logprob.numpy(),
                                           teacher, student, 16)
        assert item.teacher.segment_ids.tolist() == positions.tolist()
        np.testing.assert_allclose(item.teacher.segment_logprobs[:len(sums)].numpy(), sums, rtol=1e-5)


def test_alignments_are_kept_batch_prepared_and_reloaded_from_a_sidecar(tmp_path, tokenizers_pair):
    """A row read again, a row after ``prepare`` (batch encode) and a row after loading the sidecar equal the
    reference row; the sidecar is refused for another student tokenizer or another store, a damaged one raises."""
    from megatron_kd_plugin.cache import KDRows, row_kind
    from megatron_kd_plugin.cache.cross_tokenizer.student_alignments import StudentAlignments, sidecar_path

    teacher, student = tokenizers_pair
    n, seq = 8, 16
    small_store(tmp_path / "a.zarr", teacher, n=n)
    small_store(tmp_path / "b.zarr", teacher, n=n, fingerprint="another")
    reader = TopKCacheReader(tmp_path / "a.zarr")
    sidecar = sidecar_path(reader, student)
    assert sidecar.parent == tmp_path and sidecar.name.startswith("a.zarr.align-")
    StudentAlignments(reader, student).save(sidecar)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", sidecar.name, "b.zarr"]   # no temporary left
    lazy, prepared, loaded = (StudentAlignments(reader, student) for _ in range(3))
    prepared.prepare(range(n))
    assert loaded.load(sidecar) and len(loaded) == len(prepared) == n and len(lazy) == 0
    rows = {}
    for name, alignments in (("lazy", lazy), ("prepared", prepared), ("loaded", loaded)):
        kind = row_kind(reader, seq_length=seq, student=student, alignments="memory")
        kind.alignments = alignments
        data = KDRows(kind, np.arange(n), num_rows=2 * n, seed=0, shuffle=False)
        rows[name] = [data[i] for i in range(2 * n)]                    # two epochs: the second reads kept ones
        for i, item in enumerate(rows[name]):
            cached = reader[i % n]
            positions, sums, ids = reference_row(cached.tokens.tolist(),
                                                 cached.realised_logprob.numpy(), teacher, student, seq)
            assert item.teacher.segment_ids.tolist() == positions.tolist(), (i, alignments)
            np.testing.assert_allclose(item.teacher.segment_logprobs[:len(sums)].numpy(), sums, rtol=1e-5)
            m = int(item.loss_mask.sum())
            assert item.tokens[:m].tolist() == ids[:m] and item.labels[:m].tolist() == ids[1:m + 1]
            if name == "loaded":                                        # the token slots: the definition
                expected = reference_targets(cached.tokens.numpy(), cached.teacher.ids.numpy(),
                                             cached.teacher.logprobs.double().numpy(),
                                             cached.realised_logprob.double().numpy(), teacher, student, m)
                assert_same_targets(implementation_targets(item), expected, i)
    for name in ("lazy", "prepared"):                                   # every field, bit for bit
        for a, b in zip(rows[name], rows["loaded"]):
            for field, x, y in zip(a.teacher._fields, a.teacher, b.teacher):
                assert x.dtype == y.dtype and torch.equal(x, y), (name, field)
    assert len(lazy) == n
    assert all(isinstance(loaded.get(i).ids, np.memmap) for i in range(n))               # mapped, not copied
    revived = pickle.loads(pickle.dumps(loaded))          # a spawned data-loader worker: the path travels, re-mapped
    assert isinstance(revived.get(0).ids, np.memmap) and len(pickle.dumps(loaded)) < len(pickle.dumps(prepared))
    assert all(revived.row(i, seq).teacher.segment_ids.tolist() == loaded.row(i, seq).teacher.segment_ids.tolist() for i in range(n))
    other_student = TokenBytes.from_tokenizer(train_unigram(250), identity="unigram250")
    assert not StudentAlignments(reader, other_student).load(sidecar)
    assert not StudentAlignments(TopKCacheReader(tmp_path / "b.zarr"), student).load(sidecar)
    teacher_segments = sidecar / "teacher_segments.bin"
    flipped = bytearray(teacher_segments.read_bytes())
    flipped[5] ^= 1
    teacher_segments.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="damaged student-alignment sidecar .*teacher_segments.bin: CRC32C mismatch"):
        StudentAlignments(reader, student).load(sidecar)
    ids_file = sidecar / "ids.bin"
    ids_file.write_bytes(ids_file.read_bytes()[:-40])
    with pytest.raises(ValueError, match="damaged student-alignment sidecar .*ids.bin: .* bytes, expected"):
        StudentAlignments(reader, student).load(sidecar)


def _load_or_write_body(store, student_file, marks, processes):
    """One process of the concurrency test: map the sidecar through ``load_or_write``, noting whether it computed it;
    returns its rows' segment ids. Each process notes its arrival once it has found no sidecar, and a process that
    computes one waits until all have arrived, so that without the lock every one of them would compute it."""
    import os
    import time

    from megatron_kd_plugin.cache.cross_tokenizer.student_alignments import (StudentAlignments, load_or_write,
                                                                             sidecar_path)
    from tests.distributed import scaled

    reader, student = TopKCacheReader(store), TokenBytes.load(student_file)
    alignments = StudentAlignments(reader, student)
    load, save = alignments.load, alignments.save

    def noted_load(path, **kwargs):
        found = load(path, **kwargs)
        (marks / f"arrived-{os.getpid()}").touch()
        return found

    def noted_save(path, **kwargs):
        (marks / f"computed-{os.getpid()}").touch()
        deadline = time.monotonic() + scaled(300)
        while len(list(marks.glob("arrived-*"))) < processes:
            assert time.monotonic() < deadline, "the other processes never arrived"
            time.sleep(0.05)
        save(path, **kwargs)

    alignments.load, alignments.save = noted_load, noted_save
    load_or_write(alignments, sidecar_path(reader, student), progress=False)
    return [alignments.row(i, 16).teacher.segment_ids.tolist() for i in range(len(reader))]


def test_load_or_write_computes_the_sidecar_once_for_concurrent_processes(tmp_path, tokenizers_pair):
    """Three processes start together on a store without a sidecar: exactly one computes and writes it (the others
    wait on its lock, then map it), and all read the same rows as a fresh in-memory computation."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    from megatron_kd_plugin.cache.cross_tokenizer.student_alignments import StudentAlignments
    from tests.distributed import scaled

    teacher, student = tokenizers_pair
    small_store(tmp_path / "a.zarr", teacher, n=8)
    student.tokenizer.save(str(tmp_path / "student.json"))
    marks = tmp_path / "marks"
    marks.mkdir()
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        arguments = [(tmp_path / "a.zarr", tmp_path / "student.json", marks, 3)] * 3
        rows = list(pool.map(_load_or_write_body, *zip(*arguments), timeout=scaled(600)))
    assert len(list(marks.glob("computed-*"))) == 1
    reader = TopKCacheReader(tmp_path / "a.zarr")
    fresh = StudentAlignments(reader, TokenBytes.load(tmp_path / "student.json"))
    expected = [fresh.row(i, 16).teacher.segment_ids.tolist() for i in range(len(reader))]
    assert rows == [expected] * 3


# ---- the loss -----------------------------------------------------------------------------------------------------

def loss_inputs(seed=0, s=11, b=3, h=7, v=30):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / 2
    labels = torch.randint(0, v, (s, b), generator=g)
    segment_ids = torch.full((s, b), -1)
    for col in range(b):                                   # segments of 1..3 tokens, some tokens in none
        c, t = 0, 1 + col % 2
        while t < s:
            size = int(torch.randint(1, 4, (), generator=g))
            segment_ids[t:t + size, col] = c
            c, t = c + 1, t + size
    teacher = -torch.rand(s, b, generator=g, dtype=torch.float64) * 4
    mask = torch.ones(s, b)
    mask[-2:, 0] = 0                                       # a padded tail: its segment drops out
    return hidden, weight, labels, segment_ids, teacher, mask


def token_inputs(labels, seed=1, cached=7, v=30, k=4, j=3):
    """The token-level term's row arrays in [s, b] order (``CrossTokenizerTeacher``'s token fields) for ``labels``
    [s, b]: ``cached`` cached positions of a top-K (a third of the ids unmapped: -1, a repeated id in some rows) and
    the realised token (in the top-K at half of them), about half the student positions reading one of them (a
    boundary position), a quarter with 1..J candidates of their own (inside a teacher token)."""
    g = torch.Generator().manual_seed(seed)
    s, b = labels.shape
    ids = torch.randint(0, v, (cached, b, k), generator=g, dtype=torch.int32)
    ids[::3, :, 1] = ids[::3, :, 0]                                                    # repeats: merged buckets
    ids = ids.masked_fill(torch.rand(cached, b, k, generator=g) < 0.3, -1)
    draws = -torch.rand(cached, b, k + 2, generator=g, dtype=torch.float64).log()      # Dirichlet(1) over K + 2
    logprobs = (draws / draws.sum(-1, keepdim=True)).log()
    in_topk = torch.rand(cached, b, generator=g) < 0.5
    realised_slots = torch.where(in_topk, torch.randint(0, k, (cached, b), generator=g), k)
    realised = torch.where(in_topk, logprobs[..., :k].gather(-1, realised_slots.clamp(max=k - 1)[..., None])[..., 0],
                           logprobs[..., k])
    kind = torch.rand(s, b, generator=g)
    positions = torch.where(kind < 0.5, torch.randint(0, cached, (s, b), generator=g), -1)
    counts = torch.where((kind >= 0.5) & (kind < 0.75), torch.randint(1, j + 1, (s, b), generator=g), 0)
    present = torch.arange(j) < counts[..., None]                                      # [s, b, J]
    mid_ids = torch.randint(0, v, (s, b, j), generator=g, dtype=torch.int32).masked_fill(~present, -1)
    mid_draws = -torch.rand(s, b, j + 1, generator=g, dtype=torch.float64).log()
    mid_logprobs = (mid_draws / mid_draws.sum(-1, keepdim=True))[..., :j].log().masked_fill(~present, -torch.inf)
    return positions, ids, logprobs[..., :k], realised, realised_slots, mid_ids, mid_logprobs


def expected_token_targets(teacher: CrossTokenizerTeacher, labels):
    """(ids, log-probs) [s, b, K + 1] of each position's token-level teacher (-inf: none), from the row fields'
    meaning written out: a boundary position the top-K of its cached position, unmapped ids dropped, and the
    realised token (its top-K slot, or its own), whose id is the label; a position inside a teacher token its own
    candidates."""
    s, b = labels.shape
    k = teacher.token_ids.shape[-1]
    ids, logprobs = torch.zeros(s, b, k + 1, dtype=torch.long), torch.full((s, b, k + 1), -math.inf,
                                                                           dtype=torch.float64)
    for pos in range(s):
        for col in range(b):
            u = int(teacher.token_positions[pos, col])
            if u >= 0:
                slots = list(zip(teacher.token_ids[u, col].tolist(), teacher.token_logprobs[u, col].tolist()))
                realised = int(teacher.realised_slots[u, col])
                if realised == k:
                    slots.append((0, float(teacher.realised_logprobs[u, col])))
                slots[realised] = (int(labels[pos, col]), slots[realised][1])
            else:
                slots = list(zip(teacher.mid_ids[pos, col].tolist(), teacher.mid_logprobs[pos, col].tolist()))
            for slot, (w, lp) in enumerate(slots):
                if w >= 0 and lp > -math.inf:
                    ids[pos, col, slot], logprobs[pos, col, slot] = w, lp
    return ids, logprobs


CASES = [dict(divergence="forward_kl", temperature=1.0, alpha=1.0), dict(divergence="reverse_kl", temperature=2.0,
                                                                          alpha=0.7),
         dict(divergence="forward_kl", temperature=4.0, alpha=0.6, token_weight=0.5),
         dict(divergence="reverse_kl", temperature=1.0, alpha=1.0, token_weight=1.0)]


def cross_teacher(segment_ids, teacher_segments, tokens=None) -> CrossTokenizerTeacher:
    """The loss's teacher ([s, b] order) from a test's segment arrays and, for the token-level term, the token fields
    of ``token_inputs`` (None: no top-K, K + 1 = J = 0)."""
    s, b = segment_ids.shape
    if tokens is None:
        tokens = (torch.full((s, b), -1), torch.zeros(s, b, 0, dtype=torch.int32), torch.zeros(s, b, 0),
                  torch.zeros(s, b), torch.zeros(s, b, dtype=torch.long), torch.zeros(s, b, 0, dtype=torch.int32),
                  torch.zeros(s, b, 0))
    return CrossTokenizerTeacher(segment_ids, teacher_segments, *tokens)


def _loss_and_grads(hidden, weight, labels, segment_ids, teacher, mask, case, **kwargs):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    tokens = token_inputs(labels) if "token_weight" in case else None
    result = cross_tokenizer_loss(hidden, weight, cross_teacher(segment_ids, teacher, tokens), labels=labels,
                                  loss_mask=mask, chunk_bytes=4 * 30 * 8, **case, **kwargs)
    result.loss_sum.backward()
    return result, hidden.grad, weight.grad


def _reference(inputs, case):
    """(loss, d hidden, d weight) of the float64 reference."""
    hidden, weight = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_()
    targets = {}
    if "token_weight" in case:
        teacher = cross_teacher(inputs[3], inputs[4], token_inputs(inputs[2]))
        targets = dict(zip(("teacher_ids", "teacher_logprobs"), expected_token_targets(teacher, inputs[2])))
    expected = reference_loss(hidden, weight, *inputs[2:], **case, **targets)
    expected.backward()
    return expected.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_the_float64_reference(case):
    inputs = loss_inputs()
    result, d_hidden, d_weight = _loss_and_grads(*inputs, case)
    expected, hidden_grad, weight_grad = _reference(inputs, case)
    torch.testing.assert_close(result.loss_sum, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d_hidden, hidden_grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(d_weight, weight_grad, rtol=1e-9, atol=1e-12)
    assert int(result.num_tokens) == int((inputs[5] != 0).sum())
    if "token_weight" in case:
        ids, logprobs = expected_token_targets(cross_teacher(*inputs[3:5], token_inputs(inputs[2])), inputs[2])
        covered = torch.isfinite(logprobs).any(-1) & (inputs[5] != 0)
        assert int(result.sum("covered")) == int(covered.sum()) > 0
        logits = inputs[0] @ inputs[1].t()
        torch.testing.assert_close(result.sum("token kd loss"), reference_token_term(logits, ids, logprobs, inputs[5],
                                                                          case["divergence"]), rtol=1e-10, atol=1e-12)


def test_token_weight_needs_the_top_k_and_lies_in_0_1():
    hidden, weight, labels, segment_ids, teacher, mask = loss_inputs()
    with pytest.raises(ValueError, match="token_weight=0.5 needs the teacher's top-K"):
        cross_tokenizer_loss(hidden, weight, cross_teacher(segment_ids, teacher), labels=labels, token_weight=0.5)
    with pytest.raises(ValueError, match="token_weight=1.5: expected 0 <= token_weight <= 1"):
        cross_tokenizer_loss(hidden, weight, cross_teacher(segment_ids, teacher), labels=labels, token_weight=1.5)
    tokens = token_inputs(labels)
    beyond = (tokens[0], tokens[1].masked_fill(tokens[1] >= 0, 30), *tokens[2:])   # top-K ids outside the vocab
    with pytest.raises(ValueError, match=r"teacher_ids must lie in \[0, V=30\)"):
        cross_tokenizer_loss(hidden, weight, cross_teacher(segment_ids, teacher, beyond), labels=labels,
                             token_weight=0.5)


REAL_CASE = dict(divergence="forward_kl", temperature=1.0, alpha=0.5, token_weight=0.7)


def real_rows_case(teacher: TokenBytes, student: TokenBytes, seq: int = 24, h: int = 7):
    """Two rows of real tokenizers (``synthetic_topk`` teacher slots) in [s, b] order, random hidden states and an
    lm_head [V, H] (V even), and the token-level targets of ``reference_targets`` as [s, b, K'] arrays."""
    rng = np.random.default_rng(5)
    stream = np.asarray(sum((teacher.encode(t) + [0] for t in TEXTS), []))
    unmapped = np.flatnonzero(FirstTokens.compute(teacher, student).vocab_map < 0).astype(np.int32)
    rows, targets = [], []
    for start in (3, 200):
        tokens = stream[start:start + seq + 1]
        *topk, realised = synthetic_topk(tokens, teacher, unmapped, rng)
        rows.append(cross_tokenizer_row(tokens, realised, teacher, student, seq, topk=topk))
        targets.append(reference_targets(tokens, *topk, realised, teacher, student, int(rows[-1].loss_mask.sum())))
    batch = tensor_map(lambda t: t.transpose(0, 1), torch.utils.data.default_collate(rows)._replace(source=None))  # [s, b]
    width = max(len(t) for row in targets for t in row if t)
    ids, logprobs = torch.zeros(seq, 2, width, dtype=torch.long), torch.full((seq, 2, width), -math.inf,
                                                                             dtype=torch.float64)
    for col, row in enumerate(targets):
        for pos, target in enumerate(row):
            for slot, (w, prob) in enumerate(sorted((target or {}).items())):
                ids[pos, col, slot], logprobs[pos, col, slot] = w, math.log(prob)
    g = torch.Generator().manual_seed(6)
    vocab = len(student.strings) + len(student.strings) % 2
    hidden = torch.randn(seq, 2, h, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64) / 2
    return hidden, weight, batch, (ids, logprobs)


def real_rows_loss(hidden, weight, batch, **kwargs):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    result = cross_tokenizer_loss(hidden, weight, batch.teacher, labels=batch.labels, loss_mask=batch.loss_mask,
                                  chunk_bytes=4 * 300 * 8, **REAL_CASE, **kwargs)
    result.loss_sum.backward()
    return result.loss_sum.detach(), hidden.grad, weight.grad


def real_rows_reference(hidden, weight, batch, targets):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    teacher = batch.teacher
    expected = reference_loss(hidden, weight, batch.labels, teacher.segment_ids, teacher.segment_logprobs,
                              batch.loss_mask, **REAL_CASE, teacher_ids=targets[0], teacher_logprobs=targets[1])
    expected.backward()
    return expected.detach(), hidden.grad, weight.grad


def _tp_body(case_list, real):
    from megatron.core import parallel_state

    from megatron_kd_plugin.cache.kinds.topk import combine_logsumexp, vocab_parallel_label_logprobs

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    out = []
    for case in case_list:
        hidden, weight, *rest = loss_inputs()
        shard = weight[rank * 15:(rank + 1) * 15]            # V = 30: two shards of 15
        result, d_hidden, d_weight = _loss_and_grads(hidden, shard, *rest, case, tp_group=group)
        out.append((result.loss_sum.detach(), d_hidden, d_weight))
    hidden, weight, batch = real
    half = weight.shape[0] // 2
    out.append(real_rows_loss(hidden, weight[rank * half:(rank + 1) * half], batch, tp_group=group))
    logits = torch.randn(5, 2, 30, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 30, (5, 2), generator=torch.Generator().manual_seed(4))
    local = logits[..., rank * 15:(rank + 1) * 15]
    lse = combine_logsumexp(torch.logsumexp(local, -1), group)
    return out, vocab_parallel_label_logprobs(local, labels, lse, tp_group=group)


def test_tp2_equals_the_reference_loss_gradients_and_realised_logprobs(tokenizers_pair, unigram_eos_student):
    """The synthetic cases, and two rows of real tokenizers against the token-level term's definition written out
    over the bytes (``reference_targets``), at TP=1 and TP=2."""
    hidden, weight, batch, targets = real_rows_case(tokenizers_pair[0], unigram_eos_student)
    real_expected = real_rows_reference(hidden, weight, batch, targets)
    close = dict(rtol=1e-6, atol=1e-9)           # the rows keep the candidates' log-probs inside a token in float32
    for got, want in zip(real_rows_loss(hidden, weight, batch), real_expected):                          # TP=1
        torch.testing.assert_close(got, want, **close)
    ranks = run_on_ranks(2, _tp_body, CASES, (hidden, weight, batch), tp=2)
    logits = torch.randn(5, 2, 30, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 30, (5, 2), generator=torch.Generator().manual_seed(4))
    expected_lp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    half = weight.shape[0] // 2
    for case_index, case in enumerate(CASES + [None]):
        expected, hidden_grad, weight_grad = real_expected if case is None else _reference(loss_inputs(), case)
        shard = half if case is None else 15
        tolerance = [close] * 3 if case is None else [dict(rtol=1e-10, atol=1e-12)] + [dict(rtol=1e-9, atol=1e-12)] * 2
        for rank, (results, _) in enumerate(ranks):
            loss, d_hidden, d_weight = results[case_index]
            torch.testing.assert_close(loss, expected, **tolerance[0])
            torch.testing.assert_close(d_hidden, hidden_grad, **tolerance[1])
            torch.testing.assert_close(d_weight, weight_grad[rank * shard:(rank + 1) * shard], **tolerance[2])
    for _, realised in ranks:
        torch.testing.assert_close(realised.double(), expected_lp, rtol=0, atol=1e-5)


# ---- the Bridge path: provider, forward step, CPU loop at TP=1 and TP=2 --------------------------------------------

BRIDGE_SEQ, BRIDGE_STEPS = 40, 3


def bridge_overrides(store, student_file, *extra):
    return [f"dataset.cache_path={store}", f"dataset.student_tokenizer={student_file}", f"model.vocab_size={V_TEACHER}",
            f"model.seq_length={BRIDGE_SEQ}", f"dataset.seq_length={BRIDGE_SEQ}", f"train.train_iters={BRIDGE_STEPS}",
            *extra]


def _bridge_tp1_body(folder):
    """Write the cross-tokenizer store; the forward step's loss vs the float64 reference on the model's logits;
    the refusals; three training steps."""
    from unittest import mock

    from megatron.bridge.training.state import GlobalState

    import megatron_kd_plugin.bridge.config as kd_config
    from megatron_kd_plugin.bridge.config import check_kd_config
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.bridge.forward_step import kd_forward_step
    from megatron_kd_plugin.commands.train import build_config
    from megatron_kd_plugin.cpu_compat import seed_model_parallel
    from megatron.bridge.data.base import DatasetBuildContext

    teacher = Tokenizer.from_file(str(folder / "teacher.json"))
    stream = np.asarray(sum((teacher.encode(t).ids for t in TEXTS), []))
    source = TokenWindows(stream, 24, num_samples=16, fingerprint="xtok-bridge", tokenizer="bpe",
                          tokenizer_vocab_size=V_TEACHER)
    table = 3 * torch.randn(V_TEACHER, V_TEACHER, generator=torch.Generator().manual_seed(0))
    store, plain = folder / "xtok.zarr", folder / "plain.zarr"
    for path, vocab_table in ((store, TokenBytes.from_tokenizer(teacher, vocab_size=V_TEACHER)), (plain, None)):
        write_cache(source, lambda tokens, position_ids=None: table[tokens].transpose(0, 1), path, k=4, vocab_size=V_TEACHER,
                    teacher="table", samples_per_shard=4, progress=False, vocab_table=vocab_table)
    recipe = "tiny_gpt_xtok_kd_cpu_fp32_config"
    cfg = build_config(recipe, bridge_overrides(store, folder / "student.json"))
    cfg.model.finalize()
    check_kd_config(cfg)
    seed_model_parallel(cfg.rng.seed)
    model = cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    data = cfg.dataset.build_datasets(DatasetBuildContext(train_samples=2, valid_samples=0, test_samples=0))[0]
    batch = torch.utils.data.default_collate([data[i] for i in range(2)])     # a batch-first KDRow
    state = GlobalState()
    state.cfg = cfg
    with torch.no_grad():
        cfg.kd.token_weight = 0.0                                                       # ALM alone
        output, loss_func = kd_forward_step(state, iter([batch]), model)
        loss_sum, num_tokens, report = loss_func(output)
        cfg.kd.token_weight = 0.5
        output, loss_func = kd_forward_step(state, iter([batch]), model)
        token_loss, _, token_report = loss_func(output)
        cfg.kd.token_weight = 0.0
        positions = torch.arange(BRIDGE_SEQ).expand(2, BRIDGE_SEQ)
        mask = torch.ones(BRIDGE_SEQ, BRIDGE_SEQ, dtype=torch.bool).triu(1).view(1, 1, BRIDGE_SEQ, BRIDGE_SEQ)
        logits = model(batch.tokens, positions, mask).transpose(0, 1)                        # [s, b, V]
    expected = reference_from_logits(logits, batch.labels.t(), batch.teacher.segment_ids.t(), batch.teacher.segment_logprobs.t(),
                                     batch.loss_mask.t(), divergence="forward_kl", temperature=1.0,
                                     alpha=cfg.kd.alpha)
    targets = token_teacher(tensor_map(lambda t: t.transpose(0, 1), batch.teacher), batch.labels.t())   # [s, b, K+1]
    expected_token = reference_from_logits(
        logits, batch.labels.t(), batch.teacher.segment_ids.t(), batch.teacher.segment_logprobs.t(), batch.loss_mask.t(),
        divergence="forward_kl", temperature=1.0, alpha=cfg.kd.alpha, token_weight=0.5,
        teacher_ids=targets.ids, teacher_logprobs=targets.logprobs)
    refusals = {}
    for name, overrides in (("plain store", bridge_overrides(plain, folder / "student.json")),
                            ("no tokenizer", bridge_overrides(store, folder / "missing")),
                            ("context parallel", bridge_overrides(store, folder / "student.json",
                                                                  "model.context_parallel_size=2")),
                            ("token weight, one tokenizer", bridge_overrides(plain, "null", "kd.token_weight=0.5",
                                                                             "model.seq_length=24",
                                                                             "dataset.seq_length=24"))):
        try:
            wrong = build_config(recipe, overrides)
            wrong.model.finalize()
            with mock.patch.object(kd_config, "get_world_size_safe", lambda: 2):   # CP=2 fits a world of 2
                check_kd_config(wrong)
            refusals[name] = "accepted"
        except ValueError as exc:
            refusals[name] = str(exc)
    _, history = train_on_cpu(build_config(recipe, bridge_overrides(store, folder / "student.json",
                                                                     "kd.token_weight=0.5")), progress=False)
    return dict(loss=float(loss_sum), expected=float(expected), tokens=int(num_tokens),
                mask=int(batch.loss_mask.sum()), report=sorted(report), refusals=refusals, history=history,
                token_loss=float(token_loss), expected_token=float(expected_token), token_report=sorted(token_report),
                covered=int(torch.isfinite(targets.logprobs).any(-1).sum()),
                sidecars=[p.name for p in folder.glob("xtok.zarr.align-*") if p.is_dir()])


def _bridge_tp2_body(folder):
    from megatron_kd_plugin.bridge.cpu_train import train_on_cpu
    from megatron_kd_plugin.commands.train import build_config

    cfg = build_config("tiny_gpt_xtok_kd_cpu_fp32_config",
                       bridge_overrides(folder / "xtok.zarr", folder / "student.json",
                                        "model.tensor_model_parallel_size=2", "kd.token_weight=0.5"))
    return train_on_cpu(cfg, progress=False)[1]


def test_bridge_path_forward_step_refusals_and_tp2_training(tmp_path):
    train_bpe(V_TEACHER).save(str(tmp_path / "teacher.json"))
    train_unigram(300).save(str(tmp_path / "student.json"))
    tp1 = run_on_ranks(1, _bridge_tp1_body, tmp_path, timeout=600)[0]
    assert tp1["tokens"] == tp1["mask"] > 0
    assert math.isclose(tp1["loss"], tp1["expected"], rel_tol=1e-5), tp1
    assert tp1["report"] == ["lm loss", "segment gap", "segment loss", "segments"]
    assert tp1["covered"] > 0 and math.isclose(tp1["token_loss"], tp1["expected_token"], rel_tol=1e-5), tp1
    assert tp1["token_report"] == ["covered", "lm loss", "segment gap", "segment loss", "segments", "token kd loss"]
    assert len(tp1["sidecars"]) == 1                                      # the alignments, written beside the store
    assert "--cross-tokenizer" in tp1["refusals"]["plain store"]
    assert "no tokenizer.json" in tp1["refusals"]["no tokenizer"]
    assert "segments would be split across CP ranks" in tp1["refusals"]["context parallel"]
    assert "kd.token_weight=0.5 is for a student with its own tokenizer" in tp1["refusals"]["token weight, one tokenizer"]
    tp2 = run_on_ranks(2, _bridge_tp2_body, tmp_path, timeout=600)
    assert len(tp1["history"]) == BRIDGE_STEPS
    for rank_history in tp2:
        for a, b in zip(tp1["history"], rank_history):
            for key in ("loss", "segment loss", "lm loss", "token kd loss", "covered", "grad norm"):
                assert math.isclose(a[key], b[key], rel_tol=2e-5), (key, a, b)


def test_demo_student_tokenizer_mini_on_a_jsonl_corpus_reports_every_model_in_bits_per_byte(tmp_path):
    """``demo --student-tokenizer bpe --preset mini --corpus FILE.jsonl --text-key body``: teacher, A-ce, A-kd, B-ce and
    one B-kd row per --alm (one with the token-level term), finite bits per byte, the segment/CE gradient-norm ratio
    of each ALM run, the token-level coverage in the summary; the corpus is the file's (recorded with the teacher),
    ``--reuse`` of another corpus and a missing corpus are refused in one line; the tokenizer-transfer demo heals the
    teacher with B's vocabulary from the same folder."""
    import subprocess
    import sys
    import sysconfig

    from tests.distributed import scaled

    sources = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))
    records = [json.dumps({"id": i, "body": path.read_text(encoding="utf-8", errors="replace")[:3000]})
               for i, path in enumerate(sources[:40])]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(records) + "\n")
    out = tmp_path / "out"
    demo = [sys.executable, "-m", "megatron_kd_plugin", "demo", "--student-tokenizer", "bpe", "--preset", "mini",
            "--output", str(out)]
    done = subprocess.run(demo + ["--corpus", str(corpus), "--text-key", "body", "--alm", "1:4", "0.5:1:0.5"],
                          capture_output=True, text=True, timeout=scaled(900))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads((out / "results.json").read_text())}
    assert list(rows)[1:] == ["A-ce", "A-kd", "B-ce", "B-kd alpha=1 tau=4 gamma=0", "B-kd alpha=0.5 tau=1 gamma=0.5",
                              "coverage"]
    assert list(rows)[0].startswith("teacher") and rows[list(rows)[0]]["corpus"] == str(corpus)
    assert all(0 < row["bpb"] < 10 for name, row in rows.items() if name != "coverage")
    assert rows["B-kd alpha=1 tau=4 gamma=0"]["segment_pull"] > 0
    assert "| B-kd alpha=0.5 tau=1 gamma=0.5 |" in done.stdout and "the token-level term covers" in done.stdout
    assert rows["B-kd alpha=0.5 tau=1 gamma=0.5"]["last"]["covered"] > 0.9 and rows["coverage"]["covered"] > 0.9
    transfer = [sys.executable, "-m", "megatron_kd_plugin", "demo", "--tokenizer-transfer", "bpe", "--preset", "mini",
                "--output", str(out), "--reuse", "--corpus", str(corpus), "--text-key", "body"]
    done = subprocess.run(transfer, capture_output=True, text=True, timeout=scaled(900))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    healed = {row["name"]: row for row in json.loads((out / "transfer_results.json").read_text())}
    assert list(healed)[1:] == ["transferred (B, before healing)", "KD-healed (token-level term, alpha=0.5)",
                                "CE-healed"] and all(0 < row["bpb"] < 10 for row in healed.values())
    assert healed["KD-healed (token-level term, alpha=0.5)"]["last"]["covered"] > 0.9
    again = subprocess.run(demo + ["--reuse"], capture_output=True, text=True, timeout=scaled(300))
    assert again.returncode == 2 and "made from the corpus" in again.stderr, again.stderr[-2000:]
    missing = subprocess.run(demo + ["--corpus", str(tmp_path / "none.jsonl")], capture_output=True, text=True,
                             timeout=scaled(300))
    assert missing.returncode == 2 and "demo: error: --corpus" in missing.stderr and "no such file" in missing.stderr


OPTION_WALK = dict(tail="renorm", divergence="forward_kl", jsd_beta=0.3, temperature=1.5, alpha=0.4, token_weight=0.9,
                   impl="dense", mode="grad_in_forward", kernels="torch", chunk_bytes=4 * 30 * 3, validate=False,
                   mass_tolerance=0.5)
"""One value away from the walk's base case for every ``KDLossOptions`` field."""


def test_every_loss_option_changes_the_loss_or_is_refused_in_one_line():
    """Walks the public options (issue #40 item 2): the math options move the loss, the compute options (kernels,
    chunk size, the input checks) keep it, and the ones this loss cannot take are refused naming the setting. A new
    option fails here until it is placed in one of the three."""
    import dataclasses

    from megatron_kd_plugin.loss import KDLossOptions
    from megatron_kd_plugin.loss.cross_tokenizer_loss import FIXED_OPTIONS

    assert set(OPTION_WALK) == {f.name for f in dataclasses.fields(KDLossOptions)}
    base = dict(divergence="jsd", jsd_beta=0.5, temperature=1.0, alpha=0.7, token_weight=0.5)
    inputs = loss_inputs()
    hidden, weight, labels, segment_ids, teacher, mask = inputs
    tokens = token_inputs(labels)

    def loss(**options):
        return cross_tokenizer_loss(hidden, weight, cross_teacher(segment_ids, teacher, tokens), labels=labels,
                                    loss_mask=mask, **{**base, **options}).loss_sum

    reference = loss()
    for name, value in OPTION_WALK.items():
        if name in FIXED_OPTIONS:
            with pytest.raises(ValueError, match=f"kd.{name}={value!r} has no effect on a student with its own"):
                loss(**{name: value})
        elif name in ("kernels", "chunk_bytes", "validate", "mass_tolerance"):
            torch.testing.assert_close(loss(**{name: value}), reference, rtol=1e-10, atol=1e-12)
        else:
            assert (loss(**{name: value}) - reference).abs() > 1e-6, name
