"""Cache codec benchmark: bytes/token, round-trip error and throughput of each store candidate, one table.

    python tools/bench_cache.py                                   # synthetic peaked teacher, V=32768 and 201088
    python tools/bench_cache.py --teacher TEACHER_DIR --data PREFIX  # a save_gpt teacher on an indexed dataset
    python tools/bench_cache.py --overhead --tp 1 2                  # the cache tool's time over a plain forward

Candidates: the two rank-order baselines (raw int32 ids + raw fp16 log-probs = the 600 B/token reference, and
both blosc-compressed) written as plain zarr arrays, then the store format (ids sorted per row + delta filter)
with every log-prob codec, written by the real writer and read by the real reader. Columns: bytes/token of ids
and log-probs, total store bytes/token, round-trip KL over the K+1 ghost buckets (stored vs float32 top-K;
mean and max over tokens, nats), the fraction of tokens whose decoded top-K mass exceeds 1, writer tokens/s
excluding the teacher forward, and reader tokens/s (``TopKCacheReader[i]`` in random order, torch tensors) next
to zarr's own ``array[i]`` for ids + log-probs.

``--sampled`` prints instead bytes/token of sampled stores (issue #8) at N in ``--draws`` (t = 1, default codec,
duplicates kept and delta-coded: the store format) next to top-K stores at K in ``--topks``, and the alternative
layout it was chosen over: the distinct drawn ids (padded to N by repeating the last) + uint8 counts + their
log-probs, as plain zarr arrays with the store's codecs; plus the mean number of distinct ids and the teacher
mass they cover.

``--overhead`` saves a randomly initialised GPT teacher (``--overhead-teacher``) and an indexed dataset of random
tokens, runs ``tools/cache_teacher_logits.py`` on them under torchrun at each ``--tp`` and prints the tool's own
report: time inside the teacher forward vs the whole loop (top-K, LSE, sorting, compression, writes); with
``--sampled`` also for a sampled store at each N in ``--draws`` (sampling instead of top-K). ``--overhead-hf
qwen3|qwen3_moe`` does the same with a randomly initialised Hugging Face checkpoint of that shape (made and saved
by ``transformers``, loaded by the tool through Megatron-Bridge), at each ``--tp`` times each ``--ep``.

``--reader-codecs A B ...`` measures the reader alone on one store per log-prob codec (e.g. ``fp16-bitround7 grid8``:
the earlier default codec against today's), in alternating rounds in this one process: best rate of each,
the ratio to the first, and each store's bytes/token.

``--integrity-cost`` measures what the records (format version 3 on) cost the reader (issue 20): the default-codec
store read as written (chunk records checked) and the same store read without checking them (as a version 2 store
is read), in alternating rounds in this one process; best
rate of each, their ratio, and the bytes/token of ``chunk_records``.

``--cross-tokenizer`` (issue #18) writes one store of the synthetic teacher over real text (the running interpreter's
stdlib ``*.py`` sources, tokenized by a byte-level BPE trained on them, ``--vocab``'s first entry ids) with and without
the cross-tokenizer arrays, and prints the added bytes/token (the realised log-probs; the byte table once per store)
and the reader's teacher tokens/s (CPU seconds of this process, random order), first pass and steady state: the
same-tokenizer rows (``KDRows`` of ``SlotRows``) next to the cross-tokenizer ones (``CrossTokenizerRows``: read,
re-tokenise with a student tokenizer trained on the same text, align, cut, map the pair tokens' top-K; each sample's
alignment is kept after its first read) with its alignments made three ways before or during the first pass: on each
sample's first read, all at once by ``StudentAlignments.prepare`` (batch encode), or mapped from the sidecar folder; in
one run, so the ratios are side by side.

``--blend`` (issue #30) measures the training rows' reader on a blend of two stores against one store, side by side
in this one process: ``KDRows`` of one store (two epochs) next to ``BlendedRows`` of two stores at 0.5 / 0.5 (the
same rows read, half from each) and of two stores of K and K/2 (rows padded to K), each read in random order, best of
``--rounds`` alternating rounds; the blend must read at >= 0.9x the one store's tokens/s.

The synthetic teacher: logits z_t = a·log-Zipf prior (vocab in random order) + b·(E[x_t] · W) with random
E [V, 64], W [64, V] — one token's logits depend on that token only, with a realistic skew toward frequent ids;
a, b are set so that the mean top-100 mass is ~0.9 and the mean entropy ~2.5 nats, like a mid-size LM on text.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megatron_kd_plugin.cache import TopKCacheReader  # noqa: E402
from megatron_kd_plugin.cache.store import format as fmt  # noqa: E402
from megatron_kd_plugin.cache.kinds.top_k_store import topk_statistics  # noqa: E402
from megatron_kd_plugin.commands.inspect import stored_bytes  # noqa: E402
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows, indexed_dataset_windows  # noqa: E402
from megatron_kd_plugin.cache.kinds.topk import vocab_parallel_topk  # noqa: E402
from megatron_kd_plugin.cache.writer import write_cache  # noqa: E402


def synthetic_teacher(vocab: int, prior_scale: float = 0.9, context_scale: float = 0.55, rank: int = 64):
    """logits_fn(tokens [b, s]) -> [s, b, V] of the synthetic teacher described in the module docstring."""
    g = torch.Generator().manual_seed(vocab)
    prior = -prior_scale * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))[torch.randperm(vocab, generator=g)]
    emb = torch.randn(vocab, rank, generator=g)
    out = torch.randn(rank, vocab, generator=g) * context_scale
    return lambda tokens, position_ids=None: (prior + emb[tokens] @ out).transpose(0, 1)


def ghost_kl(exact: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """KL(exact ‖ stored) per token over the K ids plus the tail bucket; log-probs ``[..., K]`` -> ``[...]``;
    padding slots (-inf in ``exact``) count 0."""
    exact, stored = exact.double(), stored.double()
    p = exact.exp()
    tail, tail_stored = (1 - p.sum(-1)).clamp(min=0), (1 - stored.exp().sum(-1)).clamp(min=1e-12)
    tail_term = torch.where(tail > 0, tail * (torch.log(tail.clamp(min=1e-300)) - torch.log(tail_stored)), 0.0)
    kept = p > 0
    return torch.where(kept, p * (exact - torch.where(kept, stored, 0.0)), 0.0).sum(-1) + tail_term


def exact_topk(source: TokenWindows, logits_fn, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """float32 top-K (ids, log-probs ``[S, K]``, rank order) of every sample."""
    out = []
    for sample in range(len(source)):
        tokens = torch.from_numpy(source.windows(sample, sample + 1))[:, :-1]
        top = vocab_parallel_topk(logits_fn(tokens), k)
        out.append((top.ids[:, 0], top.logprobs[:, 0]))
    return out


def by_id(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), logprobs.gather(-1, order)


def reader_rate(read, n: int, tokens_per_sample: int, repeats: int = 5) -> tuple[float, float]:
    """Best of ``repeats`` random-order passes: (tokens per wall second, tokens per CPU second of this process).

    The CPU-second rate is what one process achieves on a core of its own; on a shared, loaded machine the wall
    rate mostly measures the other processes.
    """
    best_wall = best_cpu = 0.0
    for repeat in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        for i in np.random.default_rng(repeat).permutation(n):
            read(int(i))
        tokens = n * tokens_per_sample
        best_wall = max(best_wall, tokens / (time.perf_counter() - wall))
        best_cpu = max(best_cpu, tokens / max(time.process_time() - cpu, 1e-9))
    return best_wall, best_cpu


def best_alternating_rates(readers: dict, n: int, s: int, rounds: int) -> dict[str, tuple[float, float]]:
    """{name: (best wall tokens/s, best tokens per CPU-s)} over ``rounds`` rounds that read every reader in turn
    (3 random-order passes each), so that a load change hits all of them alike."""
    best = {name: (0.0, 0.0) for name in readers}
    for _ in range(rounds):
        for name, reader in readers.items():
            wall, cpu = reader_rate(reader.__getitem__, n, s, repeats=3)
            best[name] = (max(best[name][0], wall), max(best[name][1], cpu))
    return best


def integrity_cost(source, logits_fn, vocab: int, args, work: pathlib.Path, label: str) -> None:
    """Prints the reader's rate on a store with its records checked and on the same store read without them (as a
    version 2 store is read; see the docstring)."""
    store = work / "records"
    write_cache(source, logits_fn, store, k=args.k, vocab_size=vocab, teacher="bench", samples_per_shard=8,
                micro_batch_size=args.micro_batch_size, progress=False)
    unchecked = TopKCacheReader(store)
    unchecked._samples.bound = []                        # what a reader of a store without records checks
    readers = {"records checked": TopKCacheReader(store), "no records (as version 2)": unchecked}
    n, s = len(source), source.seq_length
    best = best_alternating_rates(readers, n, s, args.rounds)
    sizes = stored_bytes(store)
    records = sizes[fmt.RECORDS] / (n * s)
    print(f"\n### reader cost of the integrity records, {label}: K={args.k}, {n} samples x {s} tokens, "
          f"{fmt.DEFAULT_LOGPROB_CODEC}, best of {args.rounds} alternating rounds x 3 passes\n")
    print("| store | reader tok/s per CPU-s | wall | store B/tok |")
    print("|---|---:|---:|---:|")
    for name, total in (("no records (as version 2)", sum(sizes.values()) / (n * s) - records),
                        ("records checked", sum(sizes.values()) / (n * s))):
        print(f"| {name} | {best[name][1]:,.0f} | {best[name][0]:,.0f} | {total:.2f} |")
    ratio = best["records checked"][1] / best["no records (as version 2)"][1]
    print(f"\nrecords checked / not checked, reader rate per CPU-s: {ratio:.3f}; chunk_records: {records:.3f} B/token")


def reader_codecs(source, logits_fn, vocab: int, args, work: pathlib.Path, label: str) -> None:
    """Prints the reader's rate on one store per codec of ``--reader-codecs``, in alternating rounds in this one
    process (best of each), with each store's bytes/token."""
    readers, sizes = {}, {}
    for codec in args.reader_codecs:
        path = work / codec
        write_cache(source, logits_fn, path, k=args.k, vocab_size=vocab, teacher="bench", logprob_codec=codec,
                    samples_per_shard=8, micro_batch_size=args.micro_batch_size, progress=False)
        readers[codec], sizes[codec] = TopKCacheReader(path), stored_bytes(path)
    n, s = len(source), source.seq_length
    best = best_alternating_rates(readers, n, s, args.rounds)
    print(f"\n### reader rate per log-prob codec, {label}: K={args.k}, {n} samples x {s} tokens, best of "
          f"{args.rounds} alternating rounds x 3 random-order passes (TopKCacheReader[i], torch tensors)\n")
    print("| codec | ids B/tok | log-probs B/tok | store B/tok | reader tok/s per CPU-s | wall | vs first |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    first = best[args.reader_codecs[0]][1]
    for codec in readers:
        size = sizes[codec]
        print(f"| {codec} | {size[fmt.IDS] / (n * s):.1f} | {size[fmt.LOGPROBS] / (n * s):.1f} | "
              f"{sum(size.values()) / (n * s):.1f} | {best[codec][1]:,.0f} | {best[codec][0]:,.0f} | "
              f"{best[codec][1] / first:.3f} |")


def blend_reader(source, logits_fn, vocab: int, args, work: pathlib.Path, label: str) -> None:
    """Prints the rows' reader rate on a blend of two stores against one store (see the module docstring)."""
    from megatron_kd_plugin.cache import BlendedRows, KDRows, row_kind

    n, s = len(source), source.seq_length
    other = TokenWindows(np.random.default_rng(1).integers(0, vocab, n * s + 1), s, num_samples=n,
                         fingerprint="bench-other", tokenizer=source.tokenizer, tokenizer_vocab_size=vocab)
    kinds = {}
    for name, data, k in (("a", source, args.k), ("b", other, args.k), ("half", other, args.k // 2)):
        write_cache(data, logits_fn, work / name, k=k, vocab_size=vocab, teacher="bench", samples_per_shard=8,
                    micro_batch_size=args.micro_batch_size, progress=False)
        kinds[name] = row_kind(TopKCacheReader(work / name), seq_length=s)
    ids = np.arange(n)
    readers = {"one store (KDRows, 2 epochs)": KDRows(kinds["a"], ids, num_rows=2 * n, seed=0),
               "blend of two stores, 0.5 / 0.5 (BlendedRows)": BlendedRows(
                   [(kinds["a"], ids, 0), (kinds["b"], ids, 1)], [0.5, 0.5], num_rows=2 * n, seed=0),
               f"blend of K={args.k} and K={args.k // 2} (padded)": BlendedRows(
                   [(kinds["a"], ids, 0), (kinds["half"], ids, 1)], [0.5, 0.5], num_rows=2 * n, seed=0)}
    best = best_alternating_rates(readers, 2 * n, s, args.rounds)
    print(f"\n### training rows' reader, one store against a blend, {label}: K={args.k}, {n} samples x {s} tokens "
          f"per store, {fmt.DEFAULT_LOGPROB_CODEC}, best of {args.rounds} alternating rounds x 3 random-order passes "
          f"over {2 * n} rows, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}\n")
    print("| rows | tok/s per CPU-s | wall tok/s | vs one store (CPU-s) |")
    print("|---|---:|---:|---:|")
    first = best["one store (KDRows, 2 epochs)"][1]
    for name in readers:
        print(f"| {name} | {best[name][1]:,.0f} | {best[name][0]:,.0f} | {best[name][1] / first:.3f} |")


def baseline_rows(exact, k, work: pathlib.Path) -> list[dict]:
    """The rank-order baselines as plain zarr arrays (one chunk per sample)."""
    n, s = len(exact), exact[0][0].shape[0]
    ids = torch.stack([e[0] for e in exact]).numpy().astype(np.int32)
    logprobs = torch.stack([e[1] for e in exact]).numpy()
    rows = []
    for name, compressor in (("rank order, raw", None),
                             ("rank order, blosc-zstd shuffle", "blosc")):
        folder = work / name.replace(" ", "_").replace(",", "")
        arrays = {}
        for key, values, dtype in (("ids", ids, "int32"), ("lp", logprobs.astype(np.float16), "float16")):
            codec = BloscCodec(cname="zstd", clevel=5, shuffle="shuffle", typesize=np.dtype(dtype).itemsize) \
                if compressor else None
            arrays[key] = zarr.create_array(folder / key, shape=values.shape, chunks=(1, s, k), dtype=dtype,
                                            compressors=codec)
            arrays[key][:] = values
        sizes = {key: sum(f.stat().st_size for f in (folder / key).rglob("*") if f.is_file()) for key in arrays}
        stored = torch.from_numpy(arrays["lp"][:].astype(np.float32))
        kl = ghost_kl(torch.from_numpy(logprobs), stored)
        mass = stored.double().exp().sum(-1)
        rows.append(dict(name=name, ids=sizes["ids"], lp=sizes["lp"], total=sum(sizes.values()), kl=kl,
                         over=float((mass > 1).double().mean()), write=float("nan"),
                         read=(float("nan"), float("nan")),
                         zarr_read=reader_rate(lambda i: (arrays["ids"][i], arrays["lp"][i]), n, s)))
    return rows


def store_row(source, logits_fn, exact, k, vocab, codec, work: pathlib.Path, micro_batch_size: int) -> dict:
    path = work / f"store_{codec}"
    stats = write_cache(source, logits_fn, path, k=k, vocab_size=vocab, teacher="bench", logprob_codec=codec,
                        samples_per_shard=8, micro_batch_size=micro_batch_size, progress=False)
    reader = TopKCacheReader(path)
    n, s = len(source), source.seq_length
    kls = []
    for i in range(n):
        ids, logprobs = by_id(*exact[i])
        sample = reader[i]
        if not torch.equal(sample.teacher.ids, ids):
            raise AssertionError(f"sample {i}: stored ids differ from the teacher's top-K")
        kls.append(ghost_kl(logprobs, sample.teacher.logprobs))
    mass = np.concatenate([topk_statistics(reader.sample_arrays(i)[fmt.LOGPROBS])[0] for i in range(n)])
    sizes = stored_bytes(path)
    group = zarr.open_group(path, mode="r")
    return dict(name=f"store: ids sorted+delta, log-probs {codec}", ids=sizes[fmt.IDS], lp=sizes[fmt.LOGPROBS],
                total=sum(sizes.values()), kl=torch.cat(kls), over=float((mass > 1).mean()),
                write=stats.tokens / (stats.total_seconds - stats.forward_seconds),
                read=reader_rate(lambda i: reader[i], n, s),
                zarr_read=reader_rate(lambda i: (group[fmt.IDS][i], group[fmt.LOGPROBS][i]), n, s))


def distinct_with_counts(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layout (b) of sorted draws ``[..., N]``: distinct ids (padded by repeating the last), uint8 counts (0 on
    padding) and their log-probs, each ``[..., N]``."""
    n = ids.shape[-1]
    first = np.ones(ids.shape, dtype=bool)
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    starts = np.argsort(~first, axis=-1, kind="stable")                  # first-occurrence positions, in order
    distinct = first.sum(-1, keepdims=True)
    slot = np.broadcast_to(np.arange(n), ids.shape)
    position = np.take_along_axis(starts, np.minimum(slot, distinct - 1), -1)
    following = np.where(slot + 1 < distinct, np.take_along_axis(starts, np.minimum(slot + 1, n - 1), -1), n)
    counts = np.where(slot < distinct, following - position, 0).astype(np.uint8)
    return np.take_along_axis(ids, position, -1), counts, np.take_along_axis(logprobs, position, -1)


def sampled_rows(source, logits_fn, vocab, draws, topks, work: pathlib.Path, micro_batch_size: int) -> list[str]:
    """Markdown rows: top-K stores, sampled stores (format (a)) and layout (b) of the same draws."""
    tokens = len(source) * source.seq_length
    options = dict(vocab_size=vocab, teacher="bench", samples_per_shard=8, micro_batch_size=micro_batch_size,
                   progress=False)
    rows = []
    for k in topks:
        write_cache(source, logits_fn, work / f"top{k}", k=k, **options)
        sizes = stored_bytes(work / f"top{k}")
        mass = np.exp(zarr.open_group(work / f"top{k}", mode="r")[fmt.LOGPROBS][:].astype(np.float64)).sum(-1)
        rows.append(f"| top-K, K={k} | {sizes[fmt.IDS] / tokens:.1f} | {sizes[fmt.LOGPROBS] / tokens:.1f} | - | "
                    f"{sum(sizes.values()) / tokens:.1f} | {k} | {mass.mean():.3f} |")
    for n in draws:
        path = work / f"sampled{n}"
        write_cache(source, logits_fn, path, k=n, mode="sampled", **options)
        sizes = stored_bytes(path)
        group = zarr.open_group(path, mode="r")
        ids, logprobs = group[fmt.IDS][:], group[fmt.LOGPROBS][:]
        distinct_ids, counts, distinct_lp = distinct_with_counts(ids, logprobs)
        distinct_mass = np.where(counts > 0, np.exp(distinct_lp.astype(np.float64)), 0.0).sum(-1)
        alternative = {}
        for name, values in (("ids", distinct_ids), ("counts", counts), ("lp", distinct_lp)):
            template = group[{"ids": fmt.IDS, "counts": fmt.IDS, "lp": fmt.LOGPROBS}[name]]
            filters = template.filters if name != "counts" else ()
            compressor = fmt._blosc(values.dtype.itemsize, "bitshuffle" if name != "lp" else "shuffle")
            array = zarr.create_array(work / f"b{n}" / name, shape=values.shape, chunks=template.chunks,
                                      shards=template.shards, dtype=values.dtype, filters=filters,
                                      compressors=compressor)
            array[:] = values
            alternative[name] = sum(f.stat().st_size for f in (work / f"b{n}" / name).rglob("*") if f.is_file())
        rows.append(f"| sampled, N={n} (store: draws sorted, duplicates kept) | {sizes[fmt.IDS] / tokens:.1f} | "
                    f"{sizes[fmt.LOGPROBS] / tokens:.1f} | - | {sum(sizes.values()) / tokens:.1f} | "
                    f"{(counts > 0).sum(-1).mean():.1f} | {distinct_mass.mean():.3f} |")
        other = sum(sizes.values()) - sizes[fmt.IDS] - sizes[fmt.LOGPROBS] + sum(alternative.values())
        rows.append(f"| sampled, N={n}, layout (b): distinct ids + uint8 counts | {alternative['ids'] / tokens:.1f}"
                    f" | {alternative['lp'] / tokens:.1f} | {alternative['counts'] / tokens:.1f} | "
                    f"{other / tokens:.1f} | | |")
    return rows


def print_table(title: str, rows: list[dict], tokens: int) -> None:
    print(f"\n### {title}\n")
    print("| candidate | ids B/tok | log-probs B/tok | store B/tok | vs raw | KL mean (nats) | KL max | "
          "mass>1 | write tok/s (excl. forward) | reader tok/s wall (per CPU-s) | zarr array[i] tok/s wall "
          "(per CPU-s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    raw = rows[0]["total"]
    for r in rows:
        print(f"| {r['name']} | {r['ids'] / tokens:.1f} | {r['lp'] / tokens:.1f} | {r['total'] / tokens:.1f} | "
              f"{raw / r['total']:.2f}x | {r['kl'].mean():.2e} | {r['kl'].max():.2e} | {r['over']:.3%} | "
              f"{r['write']:,.0f} | {r['read'][0]:,.0f} ({r['read'][1]:,.0f}) | "
              f"{r['zarr_read'][0]:,.0f} ({r['zarr_read'][1]:,.0f}) |")


def teacher_source(args):
    """(source, logits_fn, vocab, label) of a save_gpt teacher at TP=1 in this process."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds
    from megatron_kd_plugin.models.gpt import gpt_logits, load_gpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1")
    apply_cpu_workarounds()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model, spec = load_gpt(args.teacher, tp_size=1)
    model.eval()
    source = indexed_dataset_windows(args.data, args.seq_length, num_samples=args.samples)
    return source, (lambda tokens, position_ids: gpt_logits(model, tokens).detach()), spec.vocab_size, f"teacher {args.teacher}"


OVERHEAD_SPECS = {   # teacher shapes for --overhead: GPT-2-small-like, and a narrower 8-layer one
    "12x768": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, vocab_size=32768),
    "8x512": dict(num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, vocab_size=32768),
}


OVERHEAD_HF_SPECS = {   # HF teachers for --overhead-hf: a 12 x 768 Qwen3 (as 12x768 above) and its 8-expert MoE
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=3072)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, mlp_only_layers=[])),
}


def save_hf_teacher(name: str, folder: pathlib.Path, seq_length: int) -> str:
    """A random-init HF checkpoint of ``OVERHEAD_HF_SPECS[name]`` saved by transformers; returns its description."""
    import transformers

    config_name, model_name, extra = OVERHEAD_HF_SPECS[name]
    config = getattr(transformers, config_name)(
        vocab_size=32768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        head_dim=64, max_position_embeddings=max(seq_length, 512), tie_word_embeddings=False, dtype="float32",
        **extra)
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).save_pretrained(folder)
    return f"{model_name} 12 x 768, V=32,768 {extra}"


def overhead_runs(args) -> None:
    """Random teacher + random indexed dataset, then the cache tool under torchrun at each TP size."""
    import os
    import subprocess

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds, seed_model_parallel
    from megatron_kd_plugin.models.gpt import GPTSpec, build_gpt, save_gpt

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_cache_overhead_"))
    try:
        if args.overhead_hf:
            print(f"teacher {save_hf_teacher(args.overhead_hf, work / 'teacher', args.seq_length)}")
        else:
            spec = GPTSpec(**OVERHEAD_SPECS[args.overhead_teacher], seq_length=args.seq_length)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29582", RANK="0", WORLD_SIZE="1")
            apply_cpu_workarounds()
            dist.init_process_group("gloo")
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            seed_model_parallel(0)
            save_gpt(build_gpt(spec, tp_size=1), spec, work / "teacher")
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            print(f"teacher {spec}")
        builder = IndexedDatasetBuilder(str(work / "data.bin"), dtype=np.int32)
        tokens = np.random.default_rng(0).integers(0, 32768, args.samples * args.seq_length + 1)
        builder.add_document(tokens.astype(np.int32), [len(tokens)])
        builder.finalize(str(work / "data.idx"))
        modes = [["--topk", str(args.k)]] + ([["--draws", str(n)] for n in args.draws] if args.sampled else [])
        for tp, ep in [(tp, ep) for tp in args.tp for ep in (args.ep if args.overhead_hf else [1])]:
            for mode in modes:
                world = tp * ep
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           str(pathlib.Path(__file__).parent / "cache_teacher_logits.py"), "--teacher",
                           str(work / "teacher"), "--data", str(work / "data"),
                           "--output", str(work / f"tp{tp}ep{ep}{''.join(mode)}.zarr"),
                           "--seq-length", str(args.seq_length), *mode, "--tp", str(tp), "--micro-batch-size",
                           str(args.micro_batch_size), "--no-progress"] + (["--ep", str(ep)] if ep > 1 else [])
                env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
                result = subprocess.run(command, env=env, capture_output=True, text=True)
                lines = [line for line in result.stdout.splitlines() if line.startswith("[cache]")]
                print(f"TP={tp}{f' EP={ep}' if ep > 1 else ''} {' '.join(mode)}: " + (
                    " | ".join(lines) if result.returncode == 0 else result.stderr[-2000:]))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stdlib_texts(max_bytes: int) -> list[str]:
    """The running interpreter's stdlib ``*.py`` sources in sorted order, up to ``max_bytes`` of UTF-8."""
    import sysconfig

    texts, total = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode())
        if total >= max_bytes:
            break
    return texts


def cross_tokenizer_runs(args) -> None:
    """The ``--cross-tokenizer`` table (module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_kd_plugin.cache import KDRows, row_kind
    from megatron_kd_plugin.cache.cross_tokenizer.student_alignments import StudentAlignments
    from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes

    vocab = args.vocab[0]
    texts = stdlib_texts(6 * args.samples * args.seq_length)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=min(vocab, 8192), special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer, uni.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    uni.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=6000, special_tokens=["<unk>"], unk_token="<unk>",
                                                           show_progress=False))
    small_bpe = Tokenizer(models.BPE())
    small_bpe.pre_tokenizer, small_bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    small_bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    teacher = TokenBytes.from_tokenizer(bpe, vocab_size=vocab)
    students = {"Unigram 6k": TokenBytes.from_tokenizer(uni), "byte-level BPE 6k": TokenBytes.from_tokenizer(small_bpe)}
    stream = np.concatenate([np.asarray(bpe.encode(t).ids + [0]) for t in texts])
    source = TokenWindows(stream, args.seq_length, num_samples=args.samples, fingerprint="bench", tokenizer="bpe",
                          tokenizer_vocab_size=vocab)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_xtok_"))
    try:
        logits_fn = synthetic_teacher(vocab)
        for name, table in (("plain", None), ("cross", teacher)):
            write_cache(source, logits_fn, work / name, k=args.k, vocab_size=vocab, teacher="bench",
                        samples_per_shard=8, micro_batch_size=args.micro_batch_size, progress=False, vocab_table=table)
        tokens = len(source) * source.seq_length
        plain, cross = (stored_bytes(work / name) for name in ("plain", "cross"))
        print(f"\n### cross-tokenizer store: K={args.k}, V={vocab:,}, {len(source)} samples x {source.seq_length} "
              f"stdlib-source tokens, codec {fmt.DEFAULT_LOGPROB_CODEC}\n")
        print("| array | bytes/token | bytes per store |\n|---|---:|---:|")
        print(f"| same-tokenizer store (all arrays) | {sum(plain.values()) / tokens:.1f} | {sum(plain.values()):,} |")
        for name in (fmt.REALISED_LOGPROB, fmt.VOCAB_OFFSETS, fmt.VOCAB_BYTES):
            print(f"| + {name} | {cross[name] / tokens:.2f} | {cross[name]:,} |")
        print(f"| cross-tokenizer store (all arrays) | {sum(cross.values()) / tokens:.1f} | {sum(cross.values()):,} |")
        reader = TopKCacheReader(work / "cross")
        ids = np.arange(len(source))
        print("\nteacher tokens/s per CPU second of this process, random order; first pass: a new dataset (and for "
              "the cross-tokenizer rows the alignment work it needs first), steady: best of 5 later passes\n")
        print("| reader | student tokens / teacher token | labels in a used segment | labels the token-level term "
              "covers | first pass | ratio | steady | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")

        def passes(make, setup=lambda data: None):
            """(first-pass rate including ``setup``, steady rate, the dataset)."""
            cpu = time.process_time()
            data = make()
            setup(data)
            for i in np.random.default_rng(99).permutation(len(source)):
                data[int(i)]
            first = tokens / (time.process_time() - cpu)
            return first, reader_rate(lambda i: data[i], len(source), source.seq_length)[1], data

        first, steady, _ = passes(lambda: KDRows(row_kind(reader, seq_length=args.seq_length), ids,
                                                 num_rows=len(source), seed=0))
        base_first, base = first, steady
        print(f"| top-K rows (same tokenizer, K={args.k}) | 1 | 1 | 1 | {first:,.0f} | 1.00 | {steady:,.0f} "
              "| 1.00 |")
        sidecar_sizes = []
        for name, student in students.items():
            sidecar = work / f"{name}.align"
            make = lambda: KDRows(row_kind(reader, seq_length=2 * args.seq_length, student=student,  # noqa: E731
                                           alignments="memory"), ids, num_rows=len(source), seed=0)
            modes = {"aligned on first read": lambda data: None,
                     "prepare() (batch encode) first": lambda data: data.kind.alignments.prepare(ids),
                     "sidecar load first": lambda data: data.kind.alignments.load(sidecar)}
            StudentAlignments(reader, student).save(sidecar)
            for mode, setup in modes.items():
                first, steady, data = passes(make, setup)
                if mode == "aligned on first read":
                    rows = [data[i] for i in range(len(source))]
                    labels = sum(float(r.loss_mask.sum()) for r in rows)
                    segmented = sum(int((r.teacher.segment_ids >= 0).sum()) for r in rows)
                    covered = sum(int(((r.teacher.token_positions >= 0) | (r.teacher.mid_ids[:, 0] >= 0)).sum())
                                  for r in rows)
                print(f"| cross-tokenizer rows, student {name}, {mode} | {labels / tokens:.3f} "
                      f"| {segmented / labels:.3f} | {covered / labels:.3f} | {first:,.0f} | {first / base_first:.2f} "
                      f"| {steady:,.0f} | {steady / base:.2f} |")
            files = {f.stem: f.stat().st_size for f in sidecar.glob("*.bin")}
            groups = {"alignment": ("ids", "student_segments", "offsets", "teacher_segments", "num_boundaries"),
                      "token slots per token": ("sources", "mid_counts", "realised_slots"),
                      "candidates inside a teacher token": ("mid_ids", "mid_logprobs", "mid_offsets")}
            parts = {group: sum(files[n] for n in names) for group, names in groups.items()}
            sidecar_sizes.append(f"| {name} | {sum(parts.values()) / tokens:.1f} | "
                                 + " | ".join(f"{size / tokens:.2f}" for size in parts.values())
                                 + f" | {files['vocab_map']:,} |")
        from megatron_kd_plugin.cache.cross_tokenizer.first_tokens import FirstTokens

        for name, student in students.items():
            cpu = time.process_time()
            table = FirstTokens.compute(teacher, student)
            print(f"\nfirst-token table of the teacher ({int((teacher.lengths > 0).sum()):,} strings, "
                  f"{len(table.first):,} entries) and {name}: {time.process_time() - cpu:.2f} CPU s")
        print("\nsidecar bytes per teacher token (`<store>.align-*`, raw arrays; the vocab map once per store)\n")
        print("| student | all | " + " | ".join(groups) + " | vocab_map bytes |\n|---|" + "---:|" * (len(groups) + 2))
        print("\n".join(sidecar_sizes))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 201088])
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--teacher", default=None, help="save_gpt folder (with --data): measure a real teacher")
    parser.add_argument("--data", default=None, help="indexed dataset prefix for --teacher")
    parser.add_argument("--overhead", action="store_true", help="measure the cache tool against a plain forward")
    parser.add_argument("--sampled", action="store_true", help="bytes/token of sampled stores next to top-K ones")
    parser.add_argument("--draws", type=int, nargs="+", default=[8, 16, 32], help="N for --sampled")
    parser.add_argument("--topks", type=int, nargs="+", default=[8, 32, 100], help="K for --sampled")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes for --overhead")
    parser.add_argument("--overhead-teacher", default="12x768", choices=sorted(OVERHEAD_SPECS),
                        help="teacher shape for --overhead")
    parser.add_argument("--overhead-hf", default=None, choices=sorted(OVERHEAD_HF_SPECS),
                        help="--overhead with a Hugging Face teacher of this architecture instead")
    parser.add_argument("--ep", type=int, nargs="+", default=[1], help="EP sizes for --overhead-hf qwen3_moe")
    parser.add_argument("--integrity-cost", action="store_true",
                        help="reader cost of format version 3's records, against the same store read as version 2")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating rounds for --integrity-cost, --reader-codecs and --blend")
    parser.add_argument("--reader-codecs", nargs="+", choices=sorted(fmt.LOGPROB_CODECS),
                        help="only the reader's rate on a store of each of these log-prob codecs, side by side")
    parser.add_argument("--blend", action="store_true",
                        help="the training rows' reader on a blend of two stores against one store (issue #30)")
    parser.add_argument("--cross-tokenizer", action="store_true",
                        help="bytes/token and reader throughput of a cross-tokenizer store (issue #18)")
    args = parser.parse_args()
    if args.cross_tokenizer:
        torch.set_grad_enabled(False)
        cross_tokenizer_runs(args)
        return
    if args.overhead or args.overhead_hf:
        overhead_runs(args)
        return
    torch.set_grad_enabled(False)
    cases = []
    if args.teacher:
        cases.append(teacher_source(args))
    else:
        for vocab in args.vocab:
            stream = np.random.default_rng(0).integers(0, vocab, args.samples * args.seq_length + 1)
            source = TokenWindows(stream, args.seq_length, num_samples=args.samples, fingerprint="bench",
                                  tokenizer="bench", tokenizer_vocab_size=vocab)
            cases.append((source, synthetic_teacher(vocab), vocab, f"synthetic peaked teacher, V={vocab:,}"))
    for source, logits_fn, vocab, label in cases:
        work = pathlib.Path(tempfile.mkdtemp(prefix="bench_cache_"))
        try:
            tokens = len(source) * source.seq_length
            if args.sampled:
                print(f"\n### {label}: {len(source)} samples x {source.seq_length} tokens, default codec "
                      f"({fmt.DEFAULT_LOGPROB_CODEC}), proposal temperature 1\n")
                print("| store | ids B/tok | log-probs B/tok | counts B/tok | store B/tok | distinct ids / token "
                      "| teacher mass of the stored ids |")
                print("|---|---:|---:|---:|---:|---:|---:|")
                print("\n".join(sampled_rows(source, logits_fn, vocab, args.draws, args.topks, work,
                                             args.micro_batch_size)))
                continue
            if args.integrity_cost:
                integrity_cost(source, logits_fn, vocab, args, work, label)
                continue
            if args.reader_codecs:
                reader_codecs(source, logits_fn, vocab, args, work, label)
                continue
            if args.blend:
                blend_reader(source, logits_fn, vocab, args, work, label)
                continue
            exact = exact_topk(source, logits_fn, args.k)
            rows = baseline_rows(exact, args.k, work)
            rows += [store_row(source, logits_fn, exact, args.k, vocab, codec, work, args.micro_batch_size)
                     for codec in fmt.LOGPROB_CODECS]
            mass, entropy = topk_statistics(torch.stack([e[1] for e in exact]).numpy())
            print_table(f"{label}: K={args.k}, {len(source)} samples x {source.seq_length} tokens; teacher top-K "
                        f"mass mean {mass.mean():.3f} (median {np.median(mass):.3f}), K+1-bucket entropy mean "
                        f"{entropy.mean():.2f} nats", rows, tokens)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
