"""The cache tool: run a teacher over token data once and write its top-K store.

    torchrun --nproc_per_node 8 -m megatron_kd_plugin cache --teacher Qwen3-8B/ --data DATA_PREFIX \\
        --output cache.zarr --seq-length 4096 --topk 100 --tp 8 --micro-batch-size 4

(``tools/cache_teacher_logits.py`` is the same command.) ``--teacher`` is a Hugging Face checkpoint folder
(config.json + safetensors, as ``save_pretrained`` writes it) of any architecture Megatron-Bridge converts, loaded
through ``AutoBridge`` (``megatron_kd_plugin.models.hf``); or a ``save_gpt`` folder (megatron-core GPTModel); or
whatever ``--teacher-loader module:function`` returns: a callable ``load(path, tp_size) -> model`` whose
``model(tokens, position_ids, attention_mask)`` gives ``[b, s, V/tp]`` logits, with the vocab size via
``--vocab-size``. A HF teacher's tokenizer is the checkpoint folder's unless ``--tokenizer`` is given; the store
records the checkpoint's identity (architecture, name, hash of config and weight headers) and its true vocabulary
(the rows Megatron pads the output layer with are masked out).

Parallelism (HF teachers): ``--tp``, ``--pp`` (forward only; the last stage takes the top-K and writes),
``--ep`` and ``--etp`` (MoE teachers: expert parallel and expert tensor parallel sizes; ``--etp`` defaults to what
the model supports: 1 where its experts have biases, as gpt-oss's do, else megatron-core's default, TP) and data
parallelism over the rest: world = TP x PP x DP for attention, and ETP x EP x PP dividing the world for the
experts (megatron-core's ``initialize_model_parallel`` builds both grids). ``save_gpt`` and loader teachers take
``--tp`` and DP. A MoE teacher runs as in inference (no token dropping, no aux losses, no
MTP). Every setting is checked before the teacher is built. Rerunning the same command resumes a killed run;
``--overwrite`` replaces a store written with other settings; the same command plus ``--repair`` checks every
written shard and rewrites the damaged ones (byte-identical to a clean run).

``--cross-tokenizer`` also stores each token's realised log-prob and the teacher tokenizer's byte table, so a
student with its own tokenizer trains from the store (issue #18, ``cache/cross_tokenizer/align.py``); JSONL data are
checked to round-trip through the byte table first.

``--draws N`` (instead of ``--topk``) writes a sampled store (issue #8): N ids per token drawn with replacement
from q ∝ p^(1/t), t = ``--proposal-temperature`` (default 1), seeded by ``--draw-seed`` and the sample index (the
same draws at any TP/DP size and after a resume). ``--head H --draws N`` keeps per token the exact top-H ids and
draws the N from the rest of the distribution (issue #40, ``cache/kinds/head_draws.py``: the head exact, the tail's
estimate unbiased).

``--layout`` (``cache/layouts/``, docs/documents-and-conversations.md) places the documents of ``--data`` in rows:
``stream`` (the default for text and indexed datasets: one token stream cut into windows), ``packed`` (the default for
conversations and prompt/response pairs: whole documents packed into rows, each attended alone) or ``document`` (one
document per row, padded; ``--split-documents`` cuts a longer one into pieces instead of refusing it). The input
kind (``--input-kind``: text, messages, prompt_response, indexed) is found from the data unless named;
``--prompt-loss`` counts a conversation's or pair's prompt tokens too, ``--no-eod-loss`` takes the end-of-document
id out of the loss targets. The layout and the mask settings are part of the store's identity: a resume with other
ones is refused. A documents layout prints its packing figures (documents, pieces, split, dropped, efficiency).

``--top-p P`` (with ``--topk K`` as the cap, ``--min-k M`` as the floor, Megatron-LM's ``--logits-save-top-p`` /
``--logits-save-top-p-min-k``) keeps per token the smallest set of its highest-probability ids whose mass reaches
P, at least M and at most K; the other slots are padding that costs ~nothing on disk (``cache/store/format.py``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_kd_plugin.cache import TopKCacheReader
from megatron_kd_plugin.cache.layouts import LAYOUTS, layout_name, open_rows
from megatron_kd_plugin.cache.store import format as fmt
from megatron_kd_plugin.cache.store import storage
from megatron_kd_plugin.cache.teacher_context_parallel import check_cp_seq_length
from megatron_kd_plugin.cache.kinds import store_kind
from megatron_kd_plugin.cache.sources import INPUT_KINDS, resolve_input_kind
from megatron_kd_plugin.cache.teacher_head import DEFAULT_CHUNK_BYTES, block_shape, row_bytes

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron_kd_plugin cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True,
                   help="teacher: a Hugging Face checkpoint folder, a save_gpt folder, or the --teacher-loader path")
    p.add_argument("--teacher-loader", default=None,
                   help="module:function(path, tp_size) -> model, instead of megatron_kd_plugin.models.gpt.load_gpt")
    p.add_argument("--vocab-size", type=int, default=None, help="teacher vocab size (needed with --teacher-loader)")
    p.add_argument("--data", required=True, help="Megatron indexed dataset PREFIX (.bin/.idx; also s3://... or "
                   "msc://..., read as megatron-core's IndexedDataset reads object storage) or a .jsonl file")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or HF name/folder; default for a HF teacher: "
                   "its checkpoint folder); required for JSONL, recorded as the tokenizer identity and checked "
                   "against the teacher vocab")
    p.add_argument("--text-key", default="text", help="JSONL field holding the text")
    p.add_argument("--input-kind", default="auto", choices=["auto", *INPUT_KINDS],
                   help="how --data holds its documents (default auto: an indexed-dataset prefix, or what the first "
                        "JSONL record's keys say: 'text', 'messages', or 'prompt' and 'response')")
    p.add_argument("--layout", default=None, choices=list(LAYOUTS),
                   help="how documents are placed in rows: stream (one token stream cut into windows; the default "
                        "for text and indexed data), packed (whole documents packed into rows, each attended alone; "
                        "the default for messages and prompt/response), document (one document per row, padded)")
    p.add_argument("--no-eod-loss", action="store_true",
                   help="packed/document rows: the end-of-document id is no loss target (Megatron's eod_mask_loss)")
    p.add_argument("--prompt-loss", action="store_true",
                   help="packed/document rows of conversations or prompt/response pairs: every token is a loss "
                        "target, the prompt's too (default: the assistant's or the response's only)")
    p.add_argument("--split-documents", action="store_true",
                   help="document rows: a document longer than --seq-length is cut into pieces of a row each "
                        "(default: refused in one line)")
    p.add_argument("--output", required=True, help="store path: a directory (e.g. cache.zarr), s3://BUCKET/PREFIX "
                   "or msc://PROFILE/PATH (docs/object-storage.md)")
    p.add_argument("--seq-length", type=int, required=True, help="tokens per sample S")
    p.add_argument("--num-samples", type=int, default=None, help="first N windows only (default: all)")
    p.add_argument("--topk", type=int, default=None, help="K of a top-K store (default 100)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="top-p store: per token the smallest set of its highest-probability ids whose mass reaches P "
                        "(0 < P <= 1), at least --min-k, at most --topk (the cap); the other slots are padding")
    p.add_argument("--min-k", type=int, default=None, metavar="M",
                   help="the least number of ids a top-p store keeps per token (default 1; only with --top-p)")
    p.add_argument("--draws", type=int, default=None, metavar="N",
                   help="write a sampled store of N draws per token instead of the top-K")
    p.add_argument("--head", type=int, default=None, metavar="H",
                   help="with --draws N: the exact top-H ids per token first, then N draws from the rest of the "
                        "distribution (H + N slots; default 0: draws from the whole distribution)")
    p.add_argument("--proposal-temperature", type=float, default=None,
                   help="t of the sampled store's proposal q ~ p^(1/t) (default 1; only with --draws)")
    p.add_argument("--draw-seed", type=int, default=None, help="seed of the draws (default 0; only with --draws)")
    p.add_argument("--temperature", type=float, default=1.0, help="cache temperature")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (world size must be a multiple)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (HF teachers)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (HF teachers on GPU, Transformer Engine "
                   "attention): each rank runs a load-balanced 1/cp of every window; 2 x --cp must divide --seq-length")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE HF teachers)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (MoE HF teachers; default: 1 "
                   "where the experts have biases, e.g. gpt-oss, else --tp); --etp x --ep x --pp must divide the world")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="HF teacher parameter dtype (auto: the checkpoint's on a GPU, float32 without CUDA)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per teacher forward")
    p.add_argument("--head-chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                   help="byte budget of one block of the fused teacher head: the block's V/tp logits and the store "
                        f"kind's work buffers (default {DEFAULT_CHUNK_BYTES}); the rows do not depend on it")
    p.add_argument("--samples-per-shard", type=int, default=None,
                   help="samples per shard file, the unit a writer owns and a kill redoes (default: 2^20 tokens a "
                        "shard, i.e. 2^20 / --seq-length samples; docs/caching.md 'At scale')")
    p.add_argument("--logprob-codec", default=None, choices=sorted(fmt.LOGPROB_CODECS),
                   help="grid8 (the default of a top-K): a float16 row maximum and 8-bit codes below it (its log-prob "
                        "array ~70 B/token at K=100, the whole store with ids ~112-130), round-trip KL ~5e-4 nats; fp16-bitround7 (the default with --draws: a grid cannot "
                        "store repeated draws), fp16-bitround8, fp16, fp32: more bytes, less error (docs/store-kinds-and-loss.md)")
    p.add_argument("--store-logsumexp", action="store_true", help="also store the teacher's full-vocab LSE")
    p.add_argument("--cross-tokenizer", action="store_true",
                   help="also store what a student with another tokenizer needs: each token's realised log-prob and "
                        "the teacher tokenizer's byte table (needs a tokenizer.json or a folder with one)")
    p.add_argument("--overwrite", action="store_true", help="replace a store written with other settings")
    p.add_argument("--repair", action="store_true", help="check every written shard of the store (written with "
                   "these settings) and rewrite the damaged ones")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.draws is None:
        extra = [flag for flag, value in (("--proposal-temperature", args.proposal_temperature),
                                          ("--draw-seed", args.draw_seed), ("--head", args.head)) if value is not None]
        if extra:
            p.error(f"{' and '.join(extra)} only apply to a sampled store: add --draws N")
        args.mode, args.slots = "topk", 100 if args.topk is None else args.topk
    else:
        if args.topk is not None:
            p.error("--topk and --draws exclude each other: a store holds the top-K or N draws per token")
        args.mode, args.slots = "sampled", args.draws + (args.head or 0)
    for flag, value in (("--topk", args.topk), ("--draws", args.draws), ("--head", args.head)):
        if value is not None and value < 1:
            p.error(f"{flag}={value}: expected >= 1")
    if args.head is not None and args.proposal_temperature not in (None, 1.0):
        p.error(f"--head with --proposal-temperature={args.proposal_temperature}: the draws beside a head follow the "
                "teacher itself (t = 1); drop one of them")
    if args.proposal_temperature is not None and not args.proposal_temperature > 0:
        p.error(f"--proposal-temperature={args.proposal_temperature}: expected > 0")
    if args.logprob_codec is not None:
        fmt.check_logprob_codec(store_kind(args), args.logprob_codec)   # ValueError: one line, before the teacher loads
    check_top_p(args)
    return args


def check_top_p(args) -> None:
    """ValueError (one line) for top-p options that do not make a store; ``args.min_k`` defaults to 1 with
    ``--top-p``."""
    if args.top_p is None:
        if args.min_k is not None:
            raise ValueError(f"--min-k={args.min_k} only applies to a top-p store: add --top-p P")
        return
    if args.mode == "sampled":
        raise ValueError("--top-p and --draws exclude each other: a top-p store keeps the most probable ids up to "
                         "the mass P (--topk K is its cap), a sampled store draws N ids from the whole distribution")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p={args.top_p}: expected 0 < P <= 1")
    args.min_k = 1 if args.min_k is None else args.min_k
    if not 1 <= args.min_k <= args.slots:
        raise ValueError(f"--min-k={args.min_k}: expected 1 <= M <= --topk={args.slots} (the cap)")


def check_world(world: int, *, tp: int, pp: int, ep: int, etp: int | None = None, cp: int = 1) -> None:
    """ValueError unless ``world`` ranks split as megatron-core splits them: TP x CP x PP x DP for attention and
    ETP x EP x PP x expert-DP for the experts (``etp`` None: TP, megatron's default)."""
    etp = tp if etp is None else etp
    for flag, size in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp), ("--cp", cp)):
        if size < 1:
            raise ValueError(f"{flag}={size}: expected >= 1")
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not a multiple of --tp x --pp = {tp} x {pp}" if cp == 1 else
                         f"world size {world} is not a multiple of --tp x --cp x --pp = {tp} x {cp} x {pp}")
    if world % (etp * ep * pp):
        hint = "; --etp 1 folds the experts over the TP ranks" if etp > 1 and world % (ep * pp) == 0 else ""
        raise ValueError(f"world size {world} is not a multiple of --etp x --ep x --pp = {etp} x {ep} x {pp} (the "
                         f"experts' grid: expert TP x EP x PP x expert data parallel{hint})")


def init_distributed(tp: int, pp: int = 1, ep: int = 1, etp: int | None = None, cp: int = 1) -> bool:
    """Process group from torchrun's environment (a single process without it), unless one exists; then megatron's
    parallel_state with these sizes (:func:`check_world` them first; ``etp`` None: TP, megatron's default). True when
    this call created the group."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds

    created = not dist.is_initialized()
    if created:
        if "RANK" not in os.environ:             # a plain single process, not under torchrun
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        apply_cpu_workarounds()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                             context_parallel_size=cp)
    return created


def teacher_kind(args) -> str:
    """"hf", "save_gpt" or "loader" (``--teacher-loader``); ValueError for a folder that is none of them."""
    from megatron_kd_plugin.models.gpt import SPEC_FILE

    if args.teacher_loader:
        return "loader"
    folder = pathlib.Path(args.teacher)
    if (folder / SPEC_FILE).is_file():
        return "save_gpt"
    if (folder / "config.json").is_file():     # models.hf.CONFIG_FILE (that module imports Megatron-Bridge)
        return "hf"
    raise ValueError(f"--teacher {args.teacher}: neither a Hugging Face checkpoint folder (config.json + "
                     f"safetensors) nor a save_gpt folder ({SPEC_FILE}); or pass --teacher-loader")


def load_teacher(args):
    """(model, vocab_size, identity) of a save_gpt or ``--teacher-loader`` teacher (megatron initialised)."""
    from megatron_kd_plugin.models.gpt import checkpoint_identity, load_gpt

    identity = checkpoint_identity(args.teacher) if pathlib.Path(args.teacher).is_dir() else args.teacher
    if args.teacher_loader:
        module, _, function = args.teacher_loader.partition(":")
        if args.vocab_size is None:
            raise ValueError("--teacher-loader needs --vocab-size")
        model = getattr(importlib.import_module(module), function)(args.teacher, args.tp)
        return model, args.vocab_size, identity
    model, spec = load_gpt(args.teacher, tp_size=args.tp)
    if args.seq_length > spec.seq_length:
        raise ValueError(f"--seq-length={args.seq_length} exceeds the teacher's seq_length={spec.seq_length}")
    return model, spec.vocab_size, identity


def hf_teacher(args):
    """(provider, vocab_size, identity, tokenizer) of a HF teacher, every check done, nothing built yet."""
    from megatron_kd_plugin.models.hf import hf_identity, hf_model_provider, read_hf_config

    config = read_hf_config(args.teacher)
    dtype = DTYPES[args.dtype]
    if dtype is None:
        dtype = torch.float32 if not torch.cuda.is_available() else \
            DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), torch.bfloat16)
    provider = hf_model_provider(args.teacher, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                                 expert_parallel=args.ep, expert_tensor_parallel=args.etp, dtype=dtype,
                                 inference=True)
    provider.context_parallel_size = args.cp
    longest = config.get("max_position_embeddings")
    if longest and args.seq_length > longest:
        raise ValueError(f"--seq-length={args.seq_length} exceeds the teacher's max_position_embeddings={longest}")
    tokenizer = args.tokenizer
    if tokenizer is None and any((pathlib.Path(args.teacher) / name).is_file()
                                 for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = args.teacher
    return provider, provider.vocab_size, hf_identity(args.teacher), tokenizer


def run(args, *, on_shard_written=lambda shards_written: None) -> None:
    """The whole tool on this rank: checks, teacher, store. Creates (and destroys) the process group unless one
    exists; initialises (and destroys) megatron's parallel_state. ``on_shard_written``: ``write_cache``'s."""
    from megatron.core import parallel_state

    from megatron_kd_plugin.cache.teacher_forward import TeacherForward
    from megatron_kd_plugin.cache.writer import check_vocab, refuse_while_written, share_summary, write_cache

    fmt.store_location(args.output)                               # before anything loads
    if not storage.is_object_url(args.data):
        fmt.local_path(args.data, "token data")
    kind = teacher_kind(args)
    if kind != "hf" and args.pp != 1:
        raise ValueError(f"--pp={args.pp}: pipeline parallelism is not supported for {kind} teachers (a Hugging "
                         "Face checkpoint folder takes --pp)")
    input_kind = resolve_input_kind(args.data, args.input_kind, text_key=args.text_key)
    layout = layout_name(input_kind, args.layout)
    check_cp(args, kind, layout=layout, cuda=torch.cuda.is_available())
    if kind != "hf" and (args.ep != 1 or args.etp is not None):
        flag = f"--ep={args.ep}" if args.ep != 1 else f"--etp={args.etp}"
        raise ValueError(f"{flag}: expert parallelism needs a MoE Hugging Face teacher")
    tokenizer, etp = args.tokenizer, None
    if kind == "hf":
        provider, vocab_size, identity, tokenizer = hf_teacher(args)
        etp = provider.expert_tensor_parallel_size            # the provider and parallel_state: the same sizes
    check_world(dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1")),
                tp=args.tp, pp=args.pp, ep=args.ep, etp=etp, cp=args.cp)
    source = open_rows(args.data, args.seq_length, tokenizer=tokenizer, layout=layout, input_kind=input_kind,
                       text_key=args.text_key, eod_loss=not args.no_eod_loss, prompt_loss=args.prompt_loss,
                       split_documents=args.split_documents, num_samples=args.num_samples)
    created = init_distributed(args.tp, args.pp, args.ep, etp, args.cp)
    try:
        share_summary(source)              # one pass over the data, on rank 0 only
        if kind == "hf":
            check_vocab(source, vocab_size)
        refuse_while_written(args.output)
        if kind == "hf":
            from megatron_kd_plugin.models.hf import build_model

            chunks = build_model(provider)
        else:
            model, vocab_size, identity = load_teacher(args)
            chunks = [model]
        for chunk in chunks:
            chunk.eval()
        check_head_chunk(args, chunks[0])
        teacher = TeacherForward(chunks, vocab_size=vocab_size,
                                 tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                 pp_group=parallel_state.get_pipeline_model_parallel_group(),
                                 lockstep=args.ep > 1, micro_batch_size=args.micro_batch_size,
                                 seq_length=args.seq_length, cp_group=parallel_state.get_context_parallel_group())
        dp_rank = parallel_state.get_data_parallel_rank()
        vocab_table = cross_tokenizer_table(args, tokenizer, vocab_size) if args.cross_tokenizer else None
        stats = write_cache(
            source, teacher, args.output, k=args.slots, vocab_size=vocab_size,
            teacher=identity, temperature=args.temperature, logprob_codec=args.logprob_codec,
            samples_per_shard=args.samples_per_shard, store_logsumexp=args.store_logsumexp,
            micro_batch_size=args.micro_batch_size, mode=args.mode,
            proposal_temperature=1.0 if args.proposal_temperature is None else args.proposal_temperature,
            sample_seed=args.draw_seed or 0, top_p=args.top_p, min_k=args.min_k, head=args.head or 0,
            overwrite=args.overwrite,
            repair=args.repair,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_rank=dp_rank, dp_size=parallel_state.get_data_parallel_world_size(),
            progress=not args.no_progress, after_shards=teacher.finish, on_shard_written=on_shard_written,
            vocab_table=vocab_table, head_chunk_bytes=args.head_chunk_bytes,
            cp_group=parallel_state.get_context_parallel_group())
        if teacher.is_last_stage and parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
            report(args, source, stats)
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def check_cp(args, kind: str, *, layout: str, cuda: bool) -> None:
    """ValueError, in one line, for a ``--cp`` the run cannot take: 2·cp must divide the window; only rows of one
    document each (megatron-core's load-balanced CP split would cut the documents of a ``layout`` of several per
    row: ``several_documents``); only a Hugging Face teacher (through Megatron-Bridge, whose provider takes the CP
    size) and only on CUDA, where Transformer Engine's attention runs context parallelism (megatron-core's local
    attention refuses it)."""
    if args.cp == 1:
        return
    check_cp_seq_length(args.seq_length, args.cp)
    if LAYOUTS[layout].several_documents:
        raise ValueError(f"--cp={args.cp} with --layout {layout}: context parallelism with rows of several documents "
                         "is not supported; cache them with --cp 1")
    if kind != "hf":
        raise ValueError(f"--cp={args.cp}: context parallelism needs a Hugging Face teacher (a {kind} teacher has no "
                         "context-parallel attention)")
    if not cuda:
        raise ValueError(f"--cp={args.cp}: context-parallel attention needs Transformer Engine on CUDA; without a "
                         "GPU run with --cp 1")


def check_head_chunk(args, model) -> None:
    """ValueError, in one line naming ``--head-chunk-bytes``, when one token row of the fused head (this rank's V/tp
    logits and the store kind's work buffers) does not fit it; before anything is written."""
    gpt = getattr(model, "module", model)                                 # GPTModel, or inside a Float16Module
    needed = row_bytes(gpt.vocab_size // args.tp, gpt.config.params_dtype.itemsize,
                       store_kind(args).work_bytes_per_logit)
    try:
        block_shape((1, 1), needed, args.head_chunk_bytes)
    except ValueError as exc:
        raise ValueError(f"--head-chunk-bytes={args.head_chunk_bytes}: {exc}".replace(
            f"chunk_bytes={args.head_chunk_bytes} is ", "")) from None


def cross_tokenizer_table(args, tokenizer: str | None, vocab_size: int):
    """The teacher tokenizer's ``token_bytes.TokenBytes`` for ``--cross-tokenizer``, checked on the first JSONL
    documents (ValueError if there is no tokenizer file, or it does not round-trip the text)."""
    import itertools
    import json

    from megatron_kd_plugin.cache.cross_tokenizer.token_bytes import TokenBytes, check_lossless

    if not tokenizer:
        raise ValueError("--cross-tokenizer needs the teacher's tokenizer: pass --tokenizer (a tokenizer.json or a "
                         "folder holding one)")
    table = TokenBytes.load(tokenizer, vocab_size=vocab_size)
    if args.data.endswith((".jsonl", ".json")):
        with open(args.data, encoding="utf-8") as f:
            texts = [json.loads(line)[args.text_key] for line in itertools.islice(f, 64) if line.strip()]
        check_lossless(table, texts, what="the teacher tokenizer")
    return table


def report(args, source, stats) -> None:
    """The run's summary lines (printed by the first writer of the last pipeline stage): the store, a documents
    layout's packing figures (the pieces dropped for want of a loss target among them), the speed."""
    from megatron_kd_plugin.cache.writer import describe_packing

    output = fmt.store_location(args.output)
    stored = sum(output.sizes().values()) if isinstance(output, storage.ObjectPrefix) else \
        sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    tokens = len(source) * source.seq_length
    spec = TopKCacheReader(args.output).spec
    slots = spec.kind.describe(spec)
    print(f"[cache] {args.output}: {len(source)} samples x {source.seq_length} tokens, {slots}, "
          f"{stored / tokens:.1f} bytes/token on disk", flush=True)
    if source.packing:
        print(f"[cache] layout {source.layout}: {describe_packing(source.packing)}", flush=True)
    if stats.tokens:
        print(f"[cache] rank {dist.get_rank()} computed {stats.tokens} tokens in {stats.total_seconds:.2f} s "
              f"({stats.tokens / stats.total_seconds:.0f} tokens/s); teacher forward {stats.forward_seconds:.2f}"
              f" s; overhead (total / plain forward) {stats.overhead:.3f}x", flush=True)
    else:
        print(f"[cache] nothing to do: all {stats.shards_skipped} shards of rank {dist.get_rank()} were already "
              "written", flush=True)


def main(argv: list[str] | None = None, *, on_shard_written=lambda shards_written: None) -> int:
    """The command; ``on_shard_written`` (``write_cache``'s) lets a test stop it at a shard boundary."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv), on_shard_written=on_shard_written)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
