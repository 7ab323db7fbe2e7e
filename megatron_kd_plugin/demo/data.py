"""Embedded demo corpus: the Python standard library's own source files, as a Megatron indexed dataset.

Every machine that runs the demo has this text without downloading anything. The steps:

1. ``stdlib_source_files``: the ``*.py`` files under the running interpreter's stdlib folder
   (``site-packages`` excluded), in a fixed order given by a hash of each relative path;
2. ``split_by_file``: whole files go to train or held-out (no file is in both), the first files in
   hash order up to a byte budget for each split;
3. ``train_tokenizer``: a byte-level BPE tokenizer (``tokenizers``) trained on the train split only,
   with ``<|endoftext|>`` (id 0) as the end-of-document token;
4. ``write_indexed_dataset``: one document per file (its tokens then EOD), written with megatron-core's
   ``IndexedDatasetBuilder`` as ``<prefix>.bin`` / ``<prefix>.idx``;
5. ``token_windows``: the concatenated token stream cut into samples of ``seq_length + 1`` tokens that
   overlap by one token (every token is a prediction target once), the layout Megatron's GPTDataset
   uses and the cache tool reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sysconfig

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

EOD_TOKEN = "<|endoftext|>"


@dataclasses.dataclass(kw_only=True, frozen=True)
class CorpusConfig:
    """What to build from the stdlib sources."""

    vocab_size: int = 4096
    """Target BPE vocabulary size (the tokenizer may end smaller on a tiny corpus)."""
    train_bytes: int = 6_000_000
    """Byte budget of the train split (whole files, first in hash order, until the budget is reached)."""
    heldout_bytes: int = 400_000
    """Byte budget of the held-out split."""
    heldout_every: int = 20
    """One file in ``heldout_every`` (by hash of its relative path) is held out."""

    def __post_init__(self):
        for name in ("vocab_size", "train_bytes", "heldout_bytes", "heldout_every"):
            if getattr(self, name) < 2:
                raise ValueError(f"CorpusConfig.{name} must be >= 2, got {getattr(self, name)}")
        if self.vocab_size > 2**31 - 1:
            raise ValueError(f"CorpusConfig.vocab_size must fit in int32, got {self.vocab_size}")


@dataclasses.dataclass(kw_only=True, frozen=True)
class DemoCorpus:
    """The files written by ``build_corpus``; ``DemoCorpus.load(folder)`` reads them back."""

    folder: pathlib.Path
    """Folder holding everything below."""
    tokenizer_path: pathlib.Path
    """``tokenizer.json`` of the trained BPE tokenizer."""
    train_prefix: pathlib.Path
    """Indexed dataset prefix (``.bin``/``.idx``) of the train split."""
    heldout_prefix: pathlib.Path
    """Indexed dataset prefix of the held-out split."""
    vocab_size: int
    """The tokenizer's real vocabulary size (models pad it, see ``padded_vocab_size``)."""
    eod_id: int
    """Id of the end-of-document token."""
    stats: dict
    """Files, bytes and tokens per split, and the stdlib folder they came from."""

    MANIFEST = "corpus.json"

    @classmethod
    def load(cls, folder: str | pathlib.Path) -> "DemoCorpus":
        folder = pathlib.Path(folder)
        meta = json.loads((folder / cls.MANIFEST).read_text())
        return cls(folder=folder, tokenizer_path=folder / meta["tokenizer"], train_prefix=folder / meta["train"],
                   heldout_prefix=folder / meta["heldout"], vocab_size=meta["vocab_size"], eod_id=meta["eod_id"],
                   stats=meta["stats"])

    def save_manifest(self) -> None:
        meta = dict(tokenizer=self.tokenizer_path.name, train=self.train_prefix.name,
                    heldout=self.heldout_prefix.name, vocab_size=self.vocab_size, eod_id=self.eod_id,
                    stats=self.stats)
        (self.folder / self.MANIFEST).write_text(json.dumps(meta, indent=1) + "\n")


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """The model's vocabulary: the tokenizer's, rounded up to ``multiple`` (divisible by any TP size used here)."""
    return -(-vocab_size // multiple) * multiple


def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard-library folder."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _path_hash(relative: pathlib.PurePath) -> int:
    return int.from_bytes(hashlib.sha256(relative.as_posix().encode()).digest()[:8], "little")


def stdlib_source_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Relative paths of the stdlib's ``*.py`` files (no ``site-packages``), ordered by a hash of the path.

    The order depends only on the relative paths, so it is the same on every machine with the same
    Python version, and any prefix of it is a spread-out sample of the library.
    """
    root = root or stdlib_root()
    files = [p.relative_to(root) for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts) and p.is_file()]
    if not files:
        raise ValueError(f"no *.py files under the stdlib folder {root}")
    return sorted(files, key=lambda p: (_path_hash(p), p.as_posix()))


def split_by_file(files: list[pathlib.Path], root: pathlib.Path, cfg: CorpusConfig) -> dict[str, list[pathlib.Path]]:
    """Assigns whole files to "train" / "heldout" by path hash; each split takes files until its byte budget."""
    splits: dict[str, list[pathlib.Path]] = {"train": [], "heldout": []}
    budget = {"train": cfg.train_bytes, "heldout": cfg.heldout_bytes}
    used = {"train": 0, "heldout": 0}
    for rel in files:
        name = "heldout" if _path_hash(rel) % cfg.heldout_every == 0 else "train"
        if used[name] < budget[name]:
            splits[name].append(rel)
            used[name] += (root / rel).stat().st_size
        if all(used[k] >= budget[k] for k in used):
            break
    for name, chosen in splits.items():
        if not chosen:
            raise ValueError(f"the {name} split is empty: raise its byte budget or lower heldout_every={cfg.heldout_every}")
    return splits


def read_sources(root: pathlib.Path, files: list[pathlib.Path]) -> list[str]:
    """The files' text (UTF-8; undecodable bytes replaced)."""
    return [(root / rel).read_text(encoding="utf-8", errors="replace") for rel in files]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on ``texts``; ``EOD_TOKEN`` gets id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def write_indexed_dataset(prefix: pathlib.Path, tokenizer: Tokenizer, texts: list[str], eod_id: int,
                          desc: str) -> int:
    """Tokenizes ``texts`` (one document each, EOD appended) into ``prefix.bin/.idx``; returns the token count."""
    dtype = np.uint16 if tokenizer.get_vocab_size() < 2**16 else np.int32
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=dtype)
    total = 0
    batch = 64
    with tqdm(total=len(texts), desc=desc, unit="file") as bar:
        for start in range(0, len(texts), batch):
            for enc in tokenizer.encode_batch(texts[start:start + batch]):
                ids = np.asarray(enc.ids + [eod_id], dtype=dtype)
                builder.add_document(ids, [len(ids)])
                total += len(ids)
            bar.update(len(texts[start:start + batch]))
    builder.finalize(get_idx_path(str(prefix)))
    return total


def build_corpus(folder: str | pathlib.Path, cfg: CorpusConfig = CorpusConfig(),
                 root: pathlib.Path | None = None) -> DemoCorpus:
    """Writes tokenizer.json, train.bin/.idx, heldout.bin/.idx and corpus.json into ``folder``."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    root = root or stdlib_root()
    splits = {name: read_sources(root, files)
              for name, files in split_by_file(stdlib_source_files(root), root, cfg).items()}
    tokenizer = train_tokenizer(splits["train"], cfg.vocab_size)
    tokenizer_path = folder / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    stats = {"stdlib": str(root)}
    prefixes = {}
    for name, texts in splits.items():
        prefixes[name] = folder / name
        tokens = write_indexed_dataset(prefixes[name], tokenizer, texts, eod_id, desc=f"tokenize {name}")
        stats[name] = dict(files=len(texts), bytes=sum(len(t.encode("utf-8")) for t in texts), tokens=tokens)
    corpus = DemoCorpus(folder=folder, tokenizer_path=tokenizer_path, train_prefix=prefixes["train"],
                        heldout_prefix=prefixes["heldout"], vocab_size=tokenizer.get_vocab_size(), eod_id=eod_id,
                        stats=stats)
    corpus.save_manifest()
    return corpus


def token_windows(prefix: str | pathlib.Path, seq_length: int, max_samples: int | None = None) -> torch.Tensor:
    """Samples of ``seq_length + 1`` tokens from the concatenated documents of an indexed dataset.

    Consecutive samples overlap by one token, so sample ``i`` covers stream positions
    ``[i*S, (i+1)*S]``; the trailing partial sample is dropped.

    Shape: returns int64 [N, seq_length + 1].
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    dataset = IndexedDataset(str(prefix))
    stream = np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64)
    n = (len(stream) - 1) // seq_length
    if max_samples is not None:
        n = min(n, max_samples)
    if n < 1:
        raise ValueError(f"{prefix} holds {len(stream)} tokens: too few for one sample of {seq_length + 1}")
    idx = torch.arange(n).unsqueeze(1) * seq_length + torch.arange(seq_length + 1)  # [N, S+1]
    return torch.from_numpy(stream)[idx]
