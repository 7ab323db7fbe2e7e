"""What a layout is asked to cut into rows: the data, how to read it, and its loss-mask settings."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_kd_plugin.cache.sources import DocumentMasks, DocumentSet, open_documents
from megatron_kd_plugin.cache.sources.source_files import load_tokenizer


@dataclass(frozen=True, kw_only=True)
class RowInput:
    """The ``--data`` of the cache command and the settings that turn it into documents."""

    data: str
    """A JSONL file or an indexed-dataset prefix (local, ``s3://``, ``msc://``)."""
    tokenizer: str | None
    """A tokenizer.json file, or a name/folder ``transformers`` loads; None: none given."""
    input_kind: str
    """``sources.INPUT_KINDS``, found already."""
    text_key: str = "text"
    """The key of a text document in a JSONL record."""
    masks: DocumentMasks = DocumentMasks()
    split_documents: bool = False
    """Per-document rows: a document longer than a row is split into pieces (else refused)."""

    def documents(self, layout: str) -> DocumentSet:
        """The documents of the data; ValueError (one line) without a tokenizer, which ends and pads them."""
        if not self.tokenizer:
            raise ValueError(f"layout {layout!r} needs --tokenizer: its end-of-document id ends every document of "
                             f"{self.data} and pads the rows")
        return open_documents(self.data, load_tokenizer(self.tokenizer), input_kind=self.input_kind,
                              text_key=self.text_key, masks=self.masks)
