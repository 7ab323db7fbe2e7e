"""Bytes per token of a packed store whose tokens of loss mask 0 hold padding slots, against the same store holding
the teacher's rows there (issue #49, item 3).

    python tools/bench_unread_padding.py [--vocab 32768] [--seq-length 512] [--samples 32] [--k 100] [--draws 64]

The rows: prompt/response pairs of random tokens, prompt and response each 16..128 tokens (the prompts about half
the tokens, as in a chat set), packed into rows of S tokens (the ``packed`` layout's best-fit decreasing); loss mask 1
on the responses and their end-of-document ids. The teacher: ``tools/bench_cache.py``'s synthetic peaked teacher
(mean top-100 mass ~0.9). For each store (the top-K under each log-prob codec, the draws under theirs), two stores
through the real writer (``write_cache``): the default (padding at mask 0: ``writer.pad_unread_tokens``) and the
same with the rows kept there (that function made a no-op). Prints one table: the share of tokens the loss reads,
then per store bytes/token of the ids, the log-probs and the whole store (on disk, every array and the metadata),
and the ratio of the whole to the kept rows' store.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_cache import synthetic_teacher  # noqa: E402

from megatron_kd_plugin.cache import writer  # noqa: E402
from megatron_kd_plugin.cache.kinds.draws_store import DrawsStore  # noqa: E402
from megatron_kd_plugin.cache.layouts.packed_layout import best_fit_decreasing  # noqa: E402
from megatron_kd_plugin.cache.layouts.planned_rows import PlannedRows  # noqa: E402
from megatron_kd_plugin.cache.sources import DocumentMasks, DocumentSet  # noqa: E402
from megatron_kd_plugin.cache.store import format as fmt  # noqa: E402
from megatron_kd_plugin.commands.inspect import stored_bytes  # noqa: E402

EOD = 0


def pairs(vocab: int, tokens: int, seed: int = 0) -> DocumentSet:
    """Prompt/response pairs of random ids in [1, vocab), ``tokens`` of them or a little more, each ending in
    :data:`EOD`; targets 0 on the prompt, 1 on the response and the end-of-document id."""
    rng = np.random.default_rng(seed)
    documents, targets, total = [], [], 0
    while total < tokens:
        prompt, response = rng.integers(16, 129, 2)
        documents.append(np.append(rng.integers(1, vocab, prompt + response), EOD))
        targets.append(np.repeat(np.array([0, 1], dtype=np.uint8), [prompt, response + 1]))
        total += len(documents[-1])
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    return DocumentSet(kind="prompt_response", tokens=np.concatenate(documents), offsets=offsets,
                       targets=np.concatenate(targets), appended=None, eod_id=EOD, masks=DocumentMasks(),
                       content=lambda: f"bench pairs seed={seed}", tokenizer="bench", tokenizer_vocab_size=vocab,
                       name="bench pairs")


def store_bytes(rows: PlannedRows, teacher, vocab: int, path: pathlib.Path, padded: bool, **store) -> dict[str, int]:
    """{array: bytes on disk} of the store of ``rows`` (``store``: ``write_cache``'s k, codec, mode) written at
    ``path``, with padding slots at the tokens of loss mask 0 or (``padded`` False) the teacher's rows there."""
    pad = writer.pad_unread_tokens
    writer.pad_unread_tokens = pad if padded else lambda arrays, loss_mask: None
    try:
        writer.write_cache(rows, teacher, path, vocab_size=vocab, teacher="synthetic", samples_per_shard=8,
                           progress=False, **store)
    finally:
        writer.pad_unread_tokens = pad
    return stored_bytes(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--samples", type=int, default=32, help="packed rows written")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--codecs", nargs="+", default=["grid8", "fp16"], help="the top-K store's log-prob codecs")
    parser.add_argument("--draws", type=int, default=64, help="the sampled store's draws per token (0: none)")
    args = parser.parse_args(argv)
    s, n = args.seq_length, args.samples
    rows = PlannedRows(pairs(args.vocab, 2 * n * (s + 1)), s, layout="packed", place=best_fit_decreasing,
                       split=True, num_samples=n)
    read = float(rows.row_masks(0, n)[0].mean())
    teacher = synthetic_teacher(args.vocab)
    print(f"{n} packed rows x S={s}, V={args.vocab:,}, K={args.k}: loss mask 1 on {read:.1%} of the tokens, "
          f"packing efficiency {rows.packing['efficiency']:.1%}")
    print("| store | tokens of loss mask 0 hold | ids B/token | log-probs B/token | store B/token | vs rows kept |")
    print("|---|---|---:|---:|---:|---:|")
    stores = {f"top-{args.k}, {codec}": dict(k=args.k, logprob_codec=codec) for codec in args.codecs}
    if args.draws:
        stores[f"{args.draws} draws, {DrawsStore.default_codec}"] = dict(k=args.draws, mode="sampled")
    with tempfile.TemporaryDirectory() as work:
        for number, (name, store) in enumerate(stores.items()):
            sizes = {padded: store_bytes(rows, teacher, args.vocab, pathlib.Path(work) / f"{number}_{padded}", padded,
                                         **store) for padded in (False, True)}
            for padded, label in ((False, "the teacher's rows"), (True, "padding slots (the default)")):
                per_token = {array: value / (n * s) for array, value in sizes[padded].items()}
                total = sum(per_token.values())
                print(f"| {name} | {label} | {per_token[fmt.IDS]:.1f} | {per_token[fmt.LOGPROBS]:.1f} | "
                      f"{total:.1f} | {total / (sum(sizes[False].values()) / (n * s)):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
