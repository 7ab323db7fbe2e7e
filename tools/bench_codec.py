"""Log-prob codec study (issue #21): bytes/token and round-trip KL of candidate codecs on real trained teachers.

    python tools/bench_codec.py prepare --output /tmp/codec_teachers --hf-teacher DEMO/teacher --hf-data DEMO/data/train
    python tools/bench_codec.py study --teachers /tmp/codec_teachers [--names ...] [--k 16 50 100] [--top-p 0.99 0.9]
                                      [--no-plain]

``prepare`` trains (or loads) the teachers once and saves each one's float64 top-100 (ids and log-probs in rank
order, normalised over the full vocabulary) with its tokens to ``OUTPUT/NAME.npz``, so the study never retrains:

- ``confident``: ``tools/bench_quality.py``'s confident teacher (the ``small`` preset of the from-scratch demo: BPE
  vocab 512, a 2 x 128 megatron-core GPT trained 1,200 steps);
- ``uncertain``: its uncertain teacher (the same with ``--vocab-size 2048 --teacher-steps 300``);
- ``hf_qwen3``: the heal demo's trained Hugging Face Qwen3 teacher (``megatron_kd_plugin/demo/qwen3_models.py``, 4 x 256,
  vocab 4,096), given as the ``teacher`` and ``data/train`` of a finished ``python -m megatron_kd_plugin demo``
  folder (``--hf-teacher``, ``--hf-data``);
- ``synthetic32768``, ``synthetic201088``: ``tools/bench_cache.py``'s synthetic peaked teacher at that vocabulary
  (16 and 8 samples of 512 random tokens).

``study`` writes, for every teacher, K and candidate, one store through the real writer path (``format.create_store``
and ``writer.store_shard``: the store's own arrays, shards, checksums and records) or, for the layouts the store
does not have (rank order, permutations), the same arrays as plain zarr arrays with the store's shard layout, and
prints one table per teacher and K: bytes/token of ids, of log-probs, of the whole store, and the round-trip KL
KL(exact ‖ stored) over the K+1 ghost buckets per token (mean and max over tokens, nats; the exact side is the
float64 top-K), and the share of tokens whose decoded top-K mass exceeds 1; then one table of store bytes/token
and mean KL per codec, teacher and K. ``--top-p P`` adds the default codec on rows cut to top-p P (the kept ids, then
padding: log-prob -inf, id 0 or the last kept id); ``--no-plain`` leaves out the plain-zarr layouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

KMAX = 100
PAD_ID = 0
"""The id of a padding slot (log-prob -inf) in the top-p rows of the study."""


def topk_rows(logits: torch.Tensor, k: int = KMAX) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, log-probs float64), each ``[..., k]`` in rank order, of logits ``[..., V]`` (float64 softmax)."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top = logprobs.topk(k, dim=-1)
    return top.indices.numpy().astype(np.int32), top.values.numpy()


def save_rows(path: pathlib.Path, tokens: torch.Tensor, logits_of, description: str, vocab: int,
              micro_batch_size: int = 8):
    """``tokens`` [N, S+1] -> ``path`` (npz): tokens, ids [N, S, KMAX], logprobs [N, S, KMAX], vocab, description."""
    ids, logprobs = [], []
    with torch.no_grad():
        for start in range(0, len(tokens), micro_batch_size):
            top = topk_rows(logits_of(tokens[start:start + micro_batch_size, :-1]))         # [b, s, K]
            ids.append(top[0])
            logprobs.append(top[1])
    np.savez(path, tokens=tokens.numpy().astype(np.int32), ids=np.concatenate(ids), logprobs=np.concatenate(logprobs),
             vocab=vocab, description=description)
    print(f"[prepare] {path}: {description}", flush=True)


def prepare_scratch_teacher(name: str, output: pathlib.Path, samples: int, **overrides) -> None:
    """Trains the quality benchmark's teacher (the ``small`` preset, ``overrides`` applied) and saves its rows."""
    from megatron_kd_plugin.demo import scratch
    from megatron_kd_plugin.demo.data import token_windows, tokenize_corpus
    from megatron_kd_plugin.demo.teacher_training import single_process_megatron
    from megatron_kd_plugin.models.gpt import gpt_logits, load_gpt

    cfg = scratch.PRESETS["small"]
    if "vocab_size" in overrides:
        cfg = dataclasses.replace(cfg, corpus=dataclasses.replace(cfg.corpus, vocab_size=overrides.pop("vocab_size")))
    cfg = dataclasses.replace(cfg, **overrides)
    work = output / name
    corpus = tokenize_corpus(cfg.corpus).save(work / "data")
    with single_process_megatron(cfg.seed):
        scratch.train_teacher(cfg, corpus, work / "teacher")
        model, spec = load_gpt(work / "teacher", tp_size=1)
        model.eval()
        tokens = token_windows(corpus.train_prefix, cfg.seq_length, max_samples=samples)
        save_rows(output / f"{name}.npz", tokens, lambda t: gpt_logits(model, t).transpose(0, 1).float(),
                  f"bench_quality {name} teacher: megatron GPT {cfg.teacher}, vocab {spec.vocab_size} "
                  f"(tokenizer {corpus.vocab_size}), {cfg.teacher_steps} steps; {len(tokens)} x {cfg.seq_length} "
                  "train tokens", spec.vocab_size)


def prepare_hf_teacher(teacher: pathlib.Path, data: pathlib.Path, output: pathlib.Path, samples: int,
                       seq_length: int) -> None:
    """The demo's trained HF Qwen3 teacher on its train split."""
    from megatron_kd_plugin.demo import qwen3_models
    from megatron_kd_plugin.demo.data import token_windows

    model = qwen3_models.load(teacher)
    tokens = token_windows(data, seq_length, max_samples=samples)
    save_rows(output / "hf_qwen3.npz", tokens, lambda t: model(input_ids=t, use_cache=False).logits.float(),
              f"demo HF Qwen3 teacher {teacher} ({model.config.num_hidden_layers} x {model.config.hidden_size}, "
              f"vocab {model.config.vocab_size}); {len(tokens)} x {seq_length} train tokens of {data}",
              model.config.vocab_size)


def prepare_synthetic(vocab: int, output: pathlib.Path, samples: int, seq_length: int) -> None:
    """``tools/bench_cache.py``'s synthetic peaked teacher at vocabulary ``vocab`` on random tokens."""
    from bench_cache import synthetic_teacher

    logits_fn = synthetic_teacher(vocab)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, samples * seq_length + 1))
    tokens = tokens.unfold(0, seq_length + 1, seq_length)[:samples]                       # [N, S+1]
    save_rows(output / f"synthetic{vocab}.npz", tokens, lambda t: logits_fn(t).transpose(0, 1), f"bench_cache "
              f"synthetic peaked teacher, V={vocab:,}; {samples} x {seq_length} random tokens", vocab,
              micro_batch_size=1)


@dataclasses.dataclass(frozen=True)
class Rows:
    """One teacher's saved rows (``prepare``): tokens [N, S+1], ids / log-probs [N, S, KMAX] in rank order."""

    name: str
    tokens: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray
    vocab: int
    description: str

    @classmethod
    def load(cls, path: pathlib.Path) -> "Rows":
        data = np.load(path)
        return cls(path.stem, data["tokens"], data["ids"], data["logprobs"], int(data["vocab"]),
                   str(data["description"]))

    def top(self, k: int, top_p: float | None = None, pad: str = "zero") -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, log-probs float64) ``[N, S, k]`` sorted by id, the store's row order; with ``top_p`` only the
        fewest highest ids whose mass reaches it are kept, the other slots padding (log-prob -inf) after the kept
        ones, with the id :data:`PAD_ID` (``pad="zero"``) or the row's last kept id (``pad="repeat"``)."""
        ids, logprobs = self.ids[..., :k].copy(), self.logprobs[..., :k].copy()
        if top_p is not None:
            mass = np.cumsum(np.exp(logprobs), axis=-1)
            kept = np.minimum((mass < top_p).sum(-1, keepdims=True) + 1, k)             # [N, S, 1]
            dropped = np.arange(k) >= kept
            logprobs[dropped] = -np.inf
            ids[dropped] = np.iinfo(np.int32).max                                         # sorts last
        order = np.argsort(ids, axis=-1, kind="stable")
        ids, logprobs = np.take_along_axis(ids, order, -1), np.take_along_axis(logprobs, order, -1)
        padding = ids == np.iinfo(np.int32).max
        if pad == "repeat":
            last = np.take_along_axis(ids, np.maximum((~padding).sum(-1, keepdims=True) - 1, 0), -1)
            ids = np.where(padding, last, ids)
        else:
            ids[padding] = PAD_ID
        return ids, logprobs


def ghost_kl(exact: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """``tools/bench_cache.py``'s round-trip KL per token (K slots + the ghost tail; padding counts 0), on numpy."""
    from bench_cache import ghost_kl as torch_ghost_kl

    return torch_ghost_kl(torch.from_numpy(exact), torch.from_numpy(np.asarray(stored, dtype=np.float64))).numpy()


def chunk_bytes(folder: pathlib.Path) -> int:
    """Bytes of an array's chunk (shard) files, its zarr.json left out."""
    return sum(f.stat().st_size for f in (folder / "c").rglob("*") if f.is_file())


def store_candidate(rows: Rows, k: int, codec: str, work: pathlib.Path, top_p: float | None = None,
                    pad: str = "zero") -> dict:
    """One store of ``codec`` through the real writer path; its sizes and round-trip KL."""
    import zarr

    from megatron_kd_plugin.cache import TopKCacheReader
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.commands.inspect import stored_bytes
    from megatron_kd_plugin.cache.writer import store_shard

    ids, exact = rows.top(k, top_p, pad)
    n, s = ids.shape[:2]
    spec = fmt.CacheSpec(k=k, vocab_size=rows.vocab, seq_length=s, num_samples=n, teacher=rows.name,
                         tokenizer=rows.name, fingerprint="bench_codec", logprob_codec=codec, samples_per_shard=16)
    path = work / f"{rows.name}_k{k}_{codec}_{top_p}_{pad}"
    fmt.create_store(path, spec)
    group = zarr.open_group(path, mode="r+")
    for shard in range(spec.num_shards):
        begin, end = spec.shard_range(shard)
        store_shard(group, spec, shard, {fmt.TOKENS: rows.tokens[begin:end], fmt.IDS: ids[begin:end],
                                         fmt.LOGPROBS: exact[begin:end].astype(spec.logprob_dtype)})
    group.attrs.update(complete=True)
    reader = TopKCacheReader(path)
    stored = np.stack([reader[i].teacher.logprobs.numpy() for i in range(n)]).astype(np.float64)
    if not all(np.array_equal(reader[i].teacher.ids.numpy(), ids[i]) for i in range(n)):
        raise AssertionError(f"{path}: the stored ids differ from the teacher's")
    if top_p is not None and not np.array_equal(np.isneginf(stored), np.isneginf(exact)):
        raise AssertionError(f"{path}: the padding slots did not come back as -inf")
    sizes = stored_bytes(path)
    return dict(ids=chunk_bytes(path / fmt.IDS), lp=chunk_bytes(path / fmt.LOGPROBS), total=sum(sizes.values()),
                kl=ghost_kl(exact, stored), over=float((np.exp(stored).sum(-1) > 1).mean()), tokens=n * s)


def plain_arrays(arrays: dict[str, tuple[np.ndarray, dict]], path: pathlib.Path,
                 lossy: tuple[str, ...] = ()) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """({name: chunk bytes}, {name: what zarr reads back}) of plain zarr arrays with the store's chunks and shards
    (one sample per chunk, 16 per shard) and CRC32C; ``arrays``: {name: (values [N, S, ...], create_array codec
    arguments)}; every array not in ``lossy`` must read back exactly."""
    import zarr
    from zarr.codecs import Crc32cCodec

    sizes, read = {}, {}
    for name, (values, codecs) in arrays.items():
        codecs = dict(codecs)
        codecs["compressors"] = list(codecs.get("compressors", [])) + [Crc32cCodec()]
        array = zarr.create_array(path / name, shape=values.shape, chunks=(1,) + values.shape[1:],
                                  shards=(16,) + values.shape[1:], dtype=values.dtype, **codecs)
        array[:] = values
        read[name] = array[:]
        if name not in lossy and not np.array_equal(read[name], values, equal_nan=True):
            raise AssertionError(f"{path / name}: zarr did not read back what was written")
        sizes[name] = chunk_bytes(path / name)
    return sizes, read


def grid_codes(codec_name: str, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float16 maxima [N, S], uint8 codes [N, S, K], decoded float64 [N, S, K]) of the grid codec ``codec_name``."""
    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.cache.logprob_grid import LogprobGrid

    step, growth, max_step, span = fmt.LOGPROB_CODECS[codec_name].grid
    codec = LogprobGrid(logprobs.shape[-1], step, growth, max_step, span)
    n, s, k = logprobs.shape
    data = np.frombuffer(codec.encode(logprobs), dtype=np.uint8)
    rows = n * s
    maxima = np.ascontiguousarray(data[:2 * rows].reshape(2, rows)[::-1].T).view(np.float16).reshape(n, s)
    decoded = codec.decode(data).astype(np.float64).reshape(n, s, k)
    return maxima, data[2 * rows:].reshape(n, s, k), decoded


def plain_candidates(rows: Rows, k: int, work: pathlib.Path) -> list[tuple[str, dict]]:
    """The layouts and numcodecs filters the store does not use, as plain zarr arrays."""
    from zarr.codecs import numcodecs as nc

    from megatron_kd_plugin.cache.store import format as fmt

    blosc = fmt._blosc
    ids, exact = rows.top(k)
    rank_ids, rank_lp = rows.ids[..., :k], rows.logprobs[..., :k]
    delta_ids = dict(filters=[nc.Delta(dtype="<i4")], compressors=[blosc(4, "shuffle")])
    out = []
    # numcodecs' own filters on the id-sorted float log-probs (absolute, not relative to the row maximum)
    for digits in (1, 2):
        quantize = nc.Quantize(digits=digits, dtype="<f4")
        array = dict(filters=[quantize], compressors=[blosc(4)])
        sizes, read = plain_arrays({"lp": (exact.astype(np.float32), array)}, work / f"quantize{digits}", ("lp",))
        decoded = read["lp"].astype(np.float64)
        out.append((f"numcodecs Quantize(digits={digits}), fp32, blosc shuffle (absolute grid 2^-"
                    f"{int(np.ceil(np.log2(10 ** digits)))})", dict(lp=sizes["lp"], kl=ghost_kl(exact, decoded),
                                                                   over=_over(decoded))))
    for scale in (16, 64):
        fso = nc.FixedScaleOffset(offset=0, scale=scale, dtype="<f8", astype="<i2")
        sizes, read = plain_arrays({"lp": (exact, dict(filters=[fso], compressors=[blosc(2)]))}, work / f"fso{scale}",
                                   ("lp",))
        decoded = read["lp"]
        out.append((f"numcodecs FixedScaleOffset(scale={scale}) -> int16, blosc shuffle (absolute grid 1/{scale}; "
                    "no -inf)", dict(lp=sizes["lp"], kl=ghost_kl(exact, decoded), over=_over(decoded))))
    maxima, codes, decoded = grid_codes(fmt.DEFAULT_LOGPROB_CODEC, exact)
    kl = ghost_kl(exact, decoded)
    # rank order: ids by rank (delta, byte shuffle), the default grid's codes by rank (non-decreasing: Delta)
    rank_maxima, rank_codes, _ = grid_codes(fmt.DEFAULT_LOGPROB_CODEC, rank_lp)
    sizes, _ = plain_arrays({"ids": (rank_ids.astype(np.int32), delta_ids),
                          "max": (rank_maxima, dict(compressors=[blosc(2)])),
                          "codes": (rank_codes, dict(filters=[nc.Delta(dtype="|u1")], compressors=[blosc(1, "noshuffle")]))},
                         work / "rank")
    out.append((f"rank order: ids delta (byte shuffle), {fmt.DEFAULT_LOGPROB_CODEC} codes Delta-coded",
                dict(ids=sizes["ids"], lp=sizes["max"] + sizes["codes"], kl=kl, over=_over(decoded))))
    # ids sorted by id, codes in rank order + the permutation (each slot's rank, uint8)
    rank_of_slot = np.argsort(np.argsort(rows.ids[..., :k], axis=-1, kind="stable"), axis=-1)   # sorted slot -> rank
    permutation = np.argsort(rank_of_slot, axis=-1).astype(np.uint8)
    sizes, _ = plain_arrays({"codes": (rank_codes, dict(filters=[nc.Delta(dtype="|u1")], compressors=[blosc(1, "noshuffle")])),
                          "perm": (permutation, dict(compressors=[blosc(1, "noshuffle")])),
                          "max": (maxima, dict(compressors=[blosc(2)]))}, work / "perm")
    out.append((f"ids sorted, {fmt.DEFAULT_LOGPROB_CODEC} codes in rank order (Delta) + uint8 permutation",
                dict(lp=sizes["codes"] + sizes["perm"] + sizes["max"], kl=kl, over=_over(decoded))))
    # the same codes through zstd directly (no blosc), and through blosc's bit shuffle
    for name, compressor in (("zstd level 9", nc.Zstd(level=9)), ("blosc bit shuffle", blosc(1, "bitshuffle"))):
        sizes, _ = plain_arrays({"max": (maxima, dict(compressors=[blosc(2)])),
                              "codes": (codes, dict(compressors=[compressor]))}, work / name.replace(" ", "_"))
        out.append((f"{fmt.DEFAULT_LOGPROB_CODEC} codes under {name}", dict(lp=sizes["max"] + sizes["codes"], kl=kl,
                                                                          over=_over(decoded))))
    # ids: alternatives to the delta + shuffle of the store
    id_layouts = {"ids delta int32, blosc bit shuffle (before)": dict(filters=[nc.Delta(dtype="<i4")],
                                                                      compressors=[blosc(4, "bitshuffle")]),
                  "ids delta int32, zstd level 19 after byte shuffle": dict(
                      filters=[nc.Delta(dtype="<i4")], compressors=[nc.Shuffle(elementsize=4), nc.Zstd(level=19)]),
                  "ids sorted, no delta, blosc byte shuffle": dict(compressors=[blosc(4, "shuffle")])}
    if rows.vocab <= 2 ** 15:
        id_layouts["ids delta as int16 (V <= 32768 only), blosc byte shuffle"] = dict(
            filters=[nc.Delta(dtype="<i4", astype="<i2")], compressors=[blosc(2, "shuffle")])
    for name, layout in id_layouts.items():
        sizes, _ = plain_arrays({"ids": (ids, layout)}, work / name.replace(" ", "_").replace(",", ""))
        out.append((name, dict(ids=sizes["ids"])))
    return out


def codec_rates(rows: Rows, k: int, repeats: int = 3) -> tuple[float, float]:
    """(encode, decode) tokens per CPU second of the default grid codec alone on the teacher's rows, one sample
    (chunk) per call, best of ``repeats`` passes."""
    import time

    from megatron_kd_plugin.cache.store import format as fmt
    from megatron_kd_plugin.cache.logprob_grid import LogprobGrid

    codec = LogprobGrid(k, *fmt.LOGPROB_CODECS[fmt.DEFAULT_LOGPROB_CODEC].grid)
    samples = [logprobs.astype(np.float32) for logprobs in rows.top(k)[1]]
    encoded = [codec.encode(sample) for sample in samples]
    tokens = sum(len(sample) for sample in samples)
    rates = []
    for work in (lambda: [codec.encode(sample) for sample in samples], lambda: [codec.decode(e) for e in encoded]):
        best = float("inf")
        for _ in range(repeats):
            begin = time.process_time()
            work()
            best = min(best, time.process_time() - begin)
        rates.append(tokens / max(best, 1e-9))
    return rates[0], rates[1]


def _over(decoded: np.ndarray) -> float:
    return float((np.exp(decoded).sum(-1) > 1).mean())


STUDY_CODECS = {   # (LogprobCodec fields) registered for the study only: the store codecs the table compares
    "fp16-bitround7 (before)": ("fp16-bitround7", None),
    "fp16-bitround7, ids byte shuffle": (None, dict(dtype="float16", keepbits=7, ids_shuffle="shuffle")),
    "fp16-bitround5, ids byte shuffle": (None, dict(dtype="float16", keepbits=5, ids_shuffle="shuffle")),
    "fp16-bitround3, ids byte shuffle": (None, dict(dtype="float16", keepbits=3, ids_shuffle="shuffle")),
    "log grid 1/16 below the row max": (None, dict(dtype="float32", grid=(1 / 16, 0.0, 1 / 16, 254 / 16),
                                                    ids_shuffle="shuffle")),
    "log grid 1/8 below the row max": (None, dict(dtype="float32", grid=(1 / 8, 0.0, 1 / 8, 24.0),
                                                   ids_shuffle="shuffle")),
    "sqrt-p grid 1/64, steps <= 0.5": (None, dict(dtype="float32", grid=(1 / 64, 0.5, 0.5, 24.0),
                                                   ids_shuffle="shuffle")),
    "sqrt-p grid 1/48, steps <= 0.5": (None, dict(dtype="float32", grid=(1 / 48, 0.5, 0.5, 24.0),
                                                   ids_shuffle="shuffle")),
    "sqrt-p grid 1/32, steps <= 0.5": (None, dict(dtype="float32", grid=(1 / 32, 0.5, 0.5, 24.0),
                                                   ids_shuffle="shuffle")),
    "sqrt-p grid 1/32, steps <= 1": (None, dict(dtype="float32", grid=(1 / 32, 0.5, 1.0, 24.0),
                                                 ids_shuffle="shuffle")),
}


def register_study_codecs() -> dict[str, str]:
    """{table name: LOGPROB_CODECS key}, the study's codecs added to ``format.LOGPROB_CODECS`` for this process."""
    from megatron_kd_plugin.cache.store import format as fmt

    names = {}
    for label, (existing, fields) in STUDY_CODECS.items():
        if existing is None:
            existing = "study:" + label
            fmt.LOGPROB_CODECS[existing] = fmt.LogprobCodec(**fields)
        names[label] = existing
    names[f"{fmt.DEFAULT_LOGPROB_CODEC} (the default: {fmt.LOGPROB_CODECS[fmt.DEFAULT_LOGPROB_CODEC].grid})"] = \
        fmt.DEFAULT_LOGPROB_CODEC
    return names


def study(args) -> None:
    import shutil
    import tempfile

    from megatron_kd_plugin.cache.store import format as fmt

    codecs = register_study_codecs()
    teachers = [Rows.load(args.teachers / f"{name}.npz") for name in args.names]
    summary = []
    for rows in teachers:
        mass = np.exp(rows.logprobs).sum(-1)
        print(f"\n## {rows.name}: {rows.description}\n\ntop-100 mass mean {mass.mean():.3f} (median "
              f"{np.median(mass):.3f}); top-1 mass mean {np.exp(rows.logprobs[..., 0]).mean():.3f}")
        for k in args.k:
            work = pathlib.Path(tempfile.mkdtemp(prefix="bench_codec_"))
            try:
                table = [(label, store_candidate(rows, k, codec, work)) for label, codec in codecs.items()]
                if args.top_p:
                    for p in args.top_p:
                        kept = (~np.isneginf(rows.top(k, p)[1])).sum(-1).mean()
                        for pad in ("zero", "repeat"):
                            result = store_candidate(rows, k, fmt.DEFAULT_LOGPROB_CODEC, work, top_p=p, pad=pad)
                            table.append((f"{fmt.DEFAULT_LOGPROB_CODEC}, top-p {p}: mean kept {kept:.1f} of {k}, "
                                          f"padding ids {'0' if pad == 'zero' else 'the last kept id'}", result))
                if not args.no_plain:
                    table += plain_candidates(rows, k, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            tokens = rows.tokens.shape[0] * (rows.tokens.shape[1] - 1)
            encode, decode = codec_rates(rows, k)
            print(f"\n### {rows.name}, K={k}: {rows.tokens.shape[0]} x {rows.tokens.shape[1] - 1} tokens; "
                  f"{fmt.DEFAULT_LOGPROB_CODEC} alone encodes {encode:,.0f} and decodes {decode:,.0f} tokens per CPU "
                  "second (one sample per call, without blosc)\n")
            print("| candidate | ids B/tok | log-probs B/tok | store B/tok | KL mean (nats) | KL max | mass>1 |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for label, r in table:
                cells = [f"{r[key] / tokens:.1f}" if key in r else "" for key in ("ids", "lp", "total")]
                kl = [f"{r['kl'].mean():.2e}", f"{r['kl'].max():.2e}"] if "kl" in r else ["", ""]
                over = f"{r['over']:.3%}" if "over" in r else ""
                print(f"| {label} | {' | '.join(cells)} | {' | '.join(kl)} | {over} |")
                if "total" in r and label in codecs:
                    summary.append((rows.name, k, label, r["total"] / tokens, r["kl"].mean()))
    print("\n### store bytes/token (round-trip KL mean) per teacher and K\n")
    keys = sorted({(name, k) for name, k, *_ in summary}, key=lambda t: (args.names.index(t[0]), t[1]))
    print("| codec | " + " | ".join(f"{name} K={k}" for name, k in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for label in codecs:
        cells = {(name, k): f"{total:.1f} ({kl:.1e})" for name, k, lab, total, kl in summary if lab == label}
        print(f"| {label} | " + " | ".join(cells.get(key, "") for key in keys) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("--output", type=pathlib.Path, required=True)
    prep.add_argument("--teachers", nargs="+", default=["confident", "uncertain", "hf_qwen3"])
    prep.add_argument("--samples", type=int, default=64)
    prep.add_argument("--hf-teacher", type=pathlib.Path)
    prep.add_argument("--hf-data", type=pathlib.Path)
    prep.add_argument("--hf-seq-length", type=int, default=128)
    prep.add_argument("--synthetic-samples", type=int, nargs=2, default=[16, 8],
                      help="samples of 512 tokens of the synthetic V=32768 and V=201088 teachers")
    run = sub.add_parser("study")
    run.add_argument("--teachers", type=pathlib.Path, required=True, help="the prepare step's output folder")
    run.add_argument("--names", nargs="+", default=["confident", "uncertain", "hf_qwen3", "synthetic32768",
                                                    "synthetic201088"])
    run.add_argument("--k", type=int, nargs="+", default=[16, 50, 100])
    run.add_argument("--top-p", type=float, nargs="*", default=[0.99], help="also the default codec on top-p rows")
    run.add_argument("--no-plain", action="store_true", help="only the store codecs (no plain-zarr layouts)")
    args = parser.parse_args(argv)
    if args.command == "study":
        study(args)
        return 0
    if args.command == "prepare":
        args.output.mkdir(parents=True, exist_ok=True)
        for name in args.teachers:
            if name == "confident":
                prepare_scratch_teacher(name, args.output, args.samples)
            elif name == "uncertain":
                prepare_scratch_teacher(name, args.output, args.samples, vocab_size=2048, teacher_steps=300)
            elif name == "hf_qwen3":
                if args.hf_teacher is None or args.hf_data is None:
                    parser.error("hf_qwen3 needs --hf-teacher and --hf-data (a finished demo folder's teacher and "
                                 "data/train)")
                prepare_hf_teacher(args.hf_teacher, args.hf_data, args.output, args.samples, args.hf_seq_length)
            elif name in ("synthetic32768", "synthetic201088"):
                vocab = int(name.removeprefix("synthetic"))
                prepare_synthetic(vocab, args.output, args.synthetic_samples[vocab > 32768], 512)
            else:
                parser.error(f"unknown teacher {name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
