"""The demo's corpus as Megatron indexed datasets: the Python standard library's own sources, or the user's text.

By default every machine that runs the demo has its text without downloading anything: the running
interpreter's stdlib ``*.py`` files (``CorpusConfig.stdlib``, ``--stdlib``: another interpreter's). Those differ
between Python builds, so a figure measured on them belongs to one build: ``corpus_fingerprint`` names the text a
run read. ``CorpusConfig.source`` (``--corpus``) replaces them with a folder of text files or a JSONL file;
everything after the first step is the same. The steps:

1. ``corpus_documents``: the documents, each with a name (a file's relative path; a JSONL record's line
   number) and its size in bytes, in a fixed order given by a hash of the name (so any prefix of the order is
   a spread-out sample): the stdlib's ``*.py`` files (``site-packages`` excluded), the ``TEXT_SUFFIXES`` files
   under a folder (hidden names skipped), or the non-blank lines of a JSONL file, one ``{text_key: str}``
   object each;
2. ``split_documents``: whole documents go to train or held-out (one in ``heldout_every`` by name hash; none
   is in both), each split taking documents in hash order up to its byte budget;
3. ``train_tokenizer``: a byte-level BPE tokenizer (``tokenizers``) trained on the train split only,
   with ``<|endoftext|>`` (id 0) as the end-of-document token;
4. ``tokenize_corpus`` tokenizes both splits in memory (one document each, EOD appended) and checks that each
   holds the tokens the caller needs; only then ``TokenizedCorpus.save`` writes them with megatron-core's
   ``IndexedDatasetBuilder`` as ``<prefix>.bin`` / ``<prefix>.idx`` (a corpus refused writes nothing);
5. ``token_windows``: the concatenated token stream cut into samples of ``seq_length + 1`` tokens that
   overlap by one token (every token is a prediction target once), the layout Megatron's GPTDataset
   uses and the cache tool reads; ``spread_windows``: a number of them spread evenly over the whole stream, with
   the document of each target token (what an evaluation resamples, ``demo.bootstrap``).

Every refusal of the corpus is a ``CorpusError`` (a ``ValueError``) naming the path and what is wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import sysconfig
from collections.abc import Mapping

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

EOD_TOKEN = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
"""The files a ``--corpus`` folder contributes (case-insensitive), one document each."""
JSONL_SUFFIXES = (".jsonl", ".json")
SPLITS = ("train", "heldout")
_LABELS = {"train": "train", "heldout": "held-out"}


class CorpusError(ValueError):
    """The corpus cannot make the demo's data: a missing path, no text, undecodable text, too little text."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class CorpusConfig:
    """What text to build the demo's data from, and how to split and tokenize it."""

    source: str | None = None
    """A folder of text files (``TEXT_SUFFIXES``, one document each) or a JSONL file (one document per line);
    None: the stdlib sources."""
    stdlib: str | None = None
    """The standard-library folder whose ``*.py`` files are the corpus when ``source`` is None (another
    interpreter's, e.g. ``~/.pyenv/versions/3.13.0/lib/python3.13``); None: the running interpreter's."""
    text_key: str = "text"
    """The field holding a JSONL record's text."""
    vocab_size: int = 4096
    """Target BPE vocabulary size (the tokenizer may end smaller on a tiny corpus)."""
    train_bytes: int = 6_000_000
    """Byte budget of the train split (whole documents, first in hash order, until the budget is reached)."""
    heldout_bytes: int = 400_000
    """Byte budget of the held-out split."""
    heldout_every: int = 20
    """One document in ``heldout_every`` (by hash of its name) is held out."""

    def __post_init__(self):
        for name in ("vocab_size", "train_bytes", "heldout_bytes", "heldout_every"):
            if getattr(self, name) < 2:
                raise ValueError(f"CorpusConfig.{name} must be >= 2, got {getattr(self, name)}")
        if self.vocab_size > 2**31 - 1:
            raise ValueError(f"CorpusConfig.vocab_size must fit in int32, got {self.vocab_size}")
        if not self.text_key:
            raise ValueError("CorpusConfig.text_key must not be empty")
        if self.source is not None and self.stdlib is not None:
            raise ValueError(f"CorpusConfig: source={self.source!r} and stdlib={self.stdlib!r} name two corpora; "
                             "give one")


@dataclasses.dataclass(kw_only=True, frozen=True)
class Document:
    """One document of a corpus: a file (read when its split takes it) or a JSONL record (held in memory)."""

    name: str
    """A file's path relative to the corpus folder, or a JSONL record's line number: what order and split hash."""
    size: int
    """Bytes (of the file on disk; of a record's UTF-8 text)."""
    path: pathlib.Path | None = None
    """The file holding the document; None for a JSONL record."""
    text: str | None = None
    """A JSONL record's text; None for a file."""
    errors: str = "strict"
    """Decoding of a file's undecodable bytes: "strict" (a ``CorpusError``) for the user's text, "replace" for the
    stdlib's few non-UTF-8 test files."""

    def read(self) -> str:
        if self.text is not None:
            return self.text
        try:
            return self.path.read_text(encoding="utf-8", errors=self.errors)
        except UnicodeDecodeError as error:
            raise CorpusError(f"{self.path}: not UTF-8 text ({error.reason} at byte {error.start}); convert it "
                              "or remove it from the corpus") from None


@dataclasses.dataclass(kw_only=True, frozen=True)
class DemoCorpus:
    """The files written by ``TokenizedCorpus.save``; ``DemoCorpus.load(folder)`` reads them back."""

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
    """Where the text came from, and documents, bytes and tokens per split."""
    chat_template: str | None = None
    """The chat template the models' tokenizer folders carry (``demo --chat``'s conversations); None: none."""

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


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def is_heldout(name: str, heldout_every: int) -> bool:
    """Whether the document named ``name`` goes to the held-out split (one name in ``heldout_every``, by hash)."""
    return _name_hash(name) % heldout_every == 0


def _hash_order(documents: list[Document]) -> list[Document]:
    """By a hash of the name only: the same order on every machine that has the same documents."""
    return sorted(documents, key=lambda d: (_name_hash(d.name), d.name))


def stdlib_documents(root: pathlib.Path | None = None) -> list[Document]:
    """The stdlib's ``*.py`` files (no ``site-packages``), in hash order (the same for one Python version)."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts) and p.is_file()]
    if not files:
        raise CorpusError(f"no *.py files under the stdlib folder {root}")
    return _hash_order([Document(name=p.relative_to(root).as_posix(), size=p.stat().st_size, path=p,
                                 errors="replace") for p in files])


def folder_documents(folder: pathlib.Path) -> list[Document]:
    """The ``TEXT_SUFFIXES`` files under ``folder`` (recursively, hidden names skipped), in hash order."""
    files, others = [], 0
    for p in folder.rglob("*"):
        if any(part.startswith(".") for part in p.relative_to(folder).parts) or not p.is_file():
            continue
        if p.suffix.lower() in TEXT_SUFFIXES:
            files.append(p)
        else:
            others += 1
    if not files:
        raise CorpusError(f"--corpus {folder}: no text files under it (looked for "
                          f"{', '.join('*' + s for s in TEXT_SUFFIXES)}; found {others} other files)")
    return _hash_order([Document(name=p.relative_to(folder).as_posix(), size=p.stat().st_size, path=p)
                        for p in files])


def jsonl_documents(path: pathlib.Path, text_key: str) -> list[Document]:
    """One document per non-blank line of ``path``, each a JSON object with a string under ``text_key``."""
    documents = []
    with path.open(encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise CorpusError(f"{path}:{number}: not JSON ({error.msg}, column {error.colno})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    found = (f"a JSON {type(record).__name__}" if not isinstance(record, dict)
                             else f"no {text_key!r} field" if text_key not in record
                             else f"{text_key!r} is {type(record[text_key]).__name__}")
                    raise CorpusError(f"{path}:{number}: not a JSON object with a {text_key!r} string ({found}); "
                                      "--text-key names the field")
                text = record[text_key]
                documents.append(Document(name=str(number), size=len(text.encode("utf-8")), text=text))
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path}: not UTF-8 text ({error.reason})") from None
    if not documents:
        raise CorpusError(f"--corpus {path}: no records (one JSON object per line, its text under {text_key!r})")
    return _hash_order(documents)


def corpus_documents(cfg: CorpusConfig) -> list[Document]:
    """The documents of ``cfg.source`` (the stdlib when None), in hash order; a ``CorpusError`` if there are none."""
    if cfg.source is None:
        if cfg.stdlib is not None and not pathlib.Path(cfg.stdlib).is_dir():
            raise CorpusError(f"--stdlib {cfg.stdlib}: no such folder")
        return stdlib_documents(pathlib.Path(cfg.stdlib) if cfg.stdlib is not None else None)
    path = pathlib.Path(cfg.source)
    if path.is_dir():
        return folder_documents(path)
    if path.is_file() and path.suffix.lower() in JSONL_SUFFIXES:
        return jsonl_documents(path, cfg.text_key)
    if path.is_file():
        raise CorpusError(f"--corpus {path}: a file must be JSONL ({', '.join(JSONL_SUFFIXES)}: one "
                          f"{{{cfg.text_key!r}: ...}} object per line); put plain text into a folder of "
                          f"{', '.join(TEXT_SUFFIXES)} files, several of them (splits are by whole file)")
    raise CorpusError(f"--corpus {path}: no such file or folder")


def split_documents(documents: list[Document], cfg: CorpusConfig) -> dict[str, list[Document]]:
    """Whole documents to "train" / "heldout" by name hash; each split takes documents until its byte budget."""
    splits: dict[str, list[Document]] = {name: [] for name in SPLITS}
    budget = {"train": cfg.train_bytes, "heldout": cfg.heldout_bytes}
    used = dict.fromkeys(SPLITS, 0)
    for doc in documents:
        name = "heldout" if is_heldout(doc.name, cfg.heldout_every) else "train"
        if used[name] < budget[name]:
            splits[name].append(doc)
            used[name] += doc.size
        if all(used[k] >= budget[k] for k in used):
            break
    for name, chosen in splits.items():
        if not chosen:
            raise CorpusError(f"{_source_name(cfg)}: the {_LABELS[name]} split is empty: its {len(documents)} "
                              f"documents, one in {cfg.heldout_every} of them held out (by a hash of the name), gave "
                              "it none; give the corpus more, smaller documents")
    return splits


def _source_name(cfg: CorpusConfig) -> str:
    return f"--corpus {cfg.source}" if cfg.source is not None else f"the stdlib sources ({_stdlib_folder(cfg)})"


def _stdlib_folder(cfg: CorpusConfig) -> pathlib.Path:
    return pathlib.Path(cfg.stdlib) if cfg.stdlib is not None else stdlib_root()


def corpus_fingerprint(splits: dict[str, list[Document]], texts: dict[str, list[str]]) -> dict:
    """What names the text a run read: the sha256 of every split's documents (split, name and UTF-8 text of each,
    in order), and the interpreter that ran it (whose stdlib is the default corpus)."""
    digest = hashlib.sha256()
    for name in SPLITS:
        for doc, text in zip(splits[name], texts[name], strict=True):
            for part in (name, doc.name, text):
                encoded = part.encode("utf-8")
                digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return {"sha256": digest.hexdigest(), "python": platform.python_version()}


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on ``texts``; ``EOD_TOKEN`` gets id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenize_documents(tokenizer: Tokenizer, texts: list[str], eod_id: int, desc: str) -> list[np.ndarray]:
    """Each text's token ids with EOD appended (uint16 below 2^16 ids, else int32)."""
    dtype = np.uint16 if tokenizer.get_vocab_size() < 2**16 else np.int32
    batch = 64
    documents = []
    with tqdm(total=len(texts), desc=desc, unit="doc") as bar:
        for start in range(0, len(texts), batch):
            documents += [np.asarray(enc.ids + [eod_id], dtype=dtype)
                          for enc in tokenizer.encode_batch(texts[start:start + batch])]
            bar.update(len(texts[start:start + batch]))
    return documents


def write_indexed_dataset(prefix: pathlib.Path, documents: list[np.ndarray]) -> None:
    """``documents`` (one token array each) as megatron-core's ``prefix.bin/.idx``."""
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=documents[0].dtype.type)
    for ids in documents:
        builder.add_document(ids, [len(ids)])
    builder.finalize(get_idx_path(str(prefix)))


@dataclasses.dataclass(kw_only=True, frozen=True)
class TokenizedCorpus:
    """A corpus tokenized in memory, checked, not yet written (``save`` writes it)."""

    tokenizer: Tokenizer
    """The BPE tokenizer trained on the train split."""
    documents: dict[str, list[np.ndarray]]
    """Split name -> one token array per document (EOD last)."""
    stats: dict
    """Where the text came from, and documents, bytes and tokens per split."""

    def save(self, folder: str | pathlib.Path) -> DemoCorpus:
        """Writes tokenizer.json, train.bin/.idx, heldout.bin/.idx and corpus.json into ``folder``."""
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer_path = folder / "tokenizer.json"
        self.tokenizer.save(str(tokenizer_path))
        for name in SPLITS:
            write_indexed_dataset(folder / name, self.documents[name])
        corpus = DemoCorpus(folder=folder, tokenizer_path=tokenizer_path, train_prefix=folder / "train",
                            heldout_prefix=folder / "heldout", vocab_size=self.tokenizer.get_vocab_size(),
                            eod_id=self.tokenizer.token_to_id(EOD_TOKEN), stats=self.stats)
        corpus.save_manifest()
        return corpus


def tokenize_corpus(cfg: CorpusConfig, needs: Mapping[str, tuple[int, str]] | None = None) -> TokenizedCorpus:
    """Documents, splits, tokenizer and tokens of ``cfg``'s corpus, in memory.

    ``needs`` maps a split name to (the tokens it must hold, why): a split with fewer is a ``CorpusError`` that
    says how much text would do, raised before anything is written.
    """
    splits = split_documents(corpus_documents(cfg), cfg)
    texts = {name: [doc.read() for doc in docs] for name, docs in splits.items()}
    tokenizer = train_tokenizer(texts["train"], cfg.vocab_size)
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    documents = {name: tokenize_documents(tokenizer, texts[name], eod_id, desc=f"tokenize {name}") for name in SPLITS}
    stats: dict = {"source": cfg.source if cfg.source is not None else f"stdlib:{_stdlib_folder(cfg)}",
                   **corpus_fingerprint(splits, texts)}
    for name in SPLITS:
        stats[name] = dict(documents=len(texts[name]), bytes=sum(len(t.encode("utf-8")) for t in texts[name]),
                           tokens=sum(len(ids) for ids in documents[name]))
    for name, (tokens, why) in (needs or {}).items():
        have = stats[name]
        if have["tokens"] < tokens:
            per_token = have["bytes"] / have["tokens"]
            budget = cfg.train_bytes if name == "train" else cfg.heldout_bytes
            raise CorpusError(
                f"{_source_name(cfg)}: too little text: the {_LABELS[name]} split ({have['documents']:,} documents, "
                f"{have['bytes']:,} bytes; budget {budget:,}) holds {have['tokens']:,} tokens, the demo needs "
                f"{tokens:,} ({why}): about {int(tokens * per_token):,} bytes of such text in that split "
                f"({per_token:.2f} bytes/token here)")
    return TokenizedCorpus(tokenizer=tokenizer, documents=documents, stats=stats)


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


def spread_windows(prefix: str | pathlib.Path, seq_length: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` of the ``token_windows`` samples, spread evenly over the whole stream (sample ``i * N // count``
    of the N), so every part of the split is evaluated, and the document each target token belongs to.

    Shapes: returns samples int64 [n, seq_length + 1] and documents int64 [n, seq_length] (the index, in the
    indexed dataset, of the document holding target ``samples[:, 1:]``), n = min(count, N).
    """
    windows = token_windows(prefix, seq_length)                                         # [N, S+1]
    chosen = torch.arange(min(count, len(windows))) * len(windows) // min(count, len(windows))
    dataset = IndexedDataset(str(prefix))                # alive while its memory-mapped lengths are read
    ends = torch.from_numpy(np.cumsum(dataset.sequence_lengths, dtype=np.int64))      # [documents]
    targets = chosen[:, None] * seq_length + torch.arange(1, seq_length + 1)            # stream positions [n, S]
    return windows[chosen], torch.searchsorted(ends, targets, right=True)
