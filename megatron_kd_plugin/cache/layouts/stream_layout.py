"""The ``stream`` layout: the documents concatenated into one token stream and cut into windows
(``sources/token_windows.py``), the teacher attending across documents, every label a loss target: Megatron's
pretraining rows, the default for text."""

from __future__ import annotations

from megatron_kd_plugin.cache.layouts.row_input import RowInput
from megatron_kd_plugin.cache.sources import DocumentMasks
from megatron_kd_plugin.cache.sources.token_windows import TokenWindows, open_source


class StreamLayout:
    """Windows over the stream of text or indexed-dataset tokens."""

    name = "stream"
    several_documents = False
    """Whether a row may hold several documents attended apart (positions restarting): a stream row is one run
    0..S-1, whatever documents it spans (the teacher attends across them)."""

    def rows(self, source: RowInput, seq_length: int, *, num_samples: int | None) -> TokenWindows:
        if source.input_kind not in ("text", "indexed"):
            raise ValueError(f"layout 'stream' has no loss mask, and {source.data} holds {source.input_kind} "
                             "documents, whose loss mask is part of them: use layout 'packed' or 'document'")
        if source.masks != DocumentMasks() or source.split_documents:
            raise ValueError(f"{source.masks.describe()}, split_documents={int(source.split_documents)}: the "
                             "'stream' layout counts every label and splits nothing; these settings apply to the "
                             "'packed' and 'document' layouts")
        return open_source(source.data, seq_length, tokenizer=source.tokenizer, num_samples=num_samples,
                           text_key=source.text_key)
