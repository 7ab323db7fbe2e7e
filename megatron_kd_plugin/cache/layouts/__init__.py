"""The row layouts, one module each, and the lookup the cache command goes through: :func:`open_rows` cuts
``--data`` into the rows of the layout it is asked for, a row source (``sources/token_windows.py``'s docstring)
the writer reads.

- ``stream_layout.py``: ``stream``, the documents concatenated and cut into windows (every label counts, the
  teacher attends across documents): the default for text and indexed datasets;
- ``packed_layout.py``: ``packed``, whole documents packed into rows (best-fit decreasing), longer ones split: the
  default for conversations and prompt/response pairs;
- ``document_layout.py``: ``document``, one document per row, padded;
- ``planned_rows.py``: the rows of the two documents layouts (pieces, masks, positions, packing figures);
  ``row_input.py``: what a layout is given.

A new layout is a module here with a ``name``, ``several_documents`` (whether a row may hold several: context
parallelism refuses such rows) and ``rows(source, seq_length, *, num_samples)``, and one line in :data:`LAYOUTS`.
"""

from __future__ import annotations

from megatron_kd_plugin.cache.layouts.document_layout import DocumentLayout
from megatron_kd_plugin.cache.layouts.packed_layout import PackedLayout
from megatron_kd_plugin.cache.layouts.row_input import RowInput
from megatron_kd_plugin.cache.layouts.stream_layout import StreamLayout
from megatron_kd_plugin.cache.sources import DocumentMasks, resolve_input_kind

LAYOUTS = {layout.name: layout for layout in (StreamLayout(), PackedLayout(), DocumentLayout())}
"""Every layout by name."""
DEFAULT_LAYOUTS = {"text": "stream", "indexed": "stream", "messages": "packed", "prompt_response": "packed"}
"""The layout of each input kind when none is asked for."""


def layout_name(input_kind: str, layout: str | None = None) -> str:
    """``layout``, or with None the default of ``input_kind`` (one of ``sources.INPUT_KINDS``, found already:
    ``sources.resolve_input_kind``); ValueError for an unknown layout."""
    name = layout or DEFAULT_LAYOUTS[input_kind]
    if name not in LAYOUTS:
        raise ValueError(f"layout {name!r}; choose one of {list(LAYOUTS)}")
    return name


def open_rows(data: str, seq_length: int, *, tokenizer: str | None = None, layout: str | None = None,
              input_kind: str = "auto", text_key: str = "text", eod_loss: bool = True, prompt_loss: bool = False,
              split_documents: bool = False, num_samples: int | None = None):
    """The rows of ``layout`` (None: the input kind's default, :data:`DEFAULT_LAYOUTS`) over ``data``.

    ``input_kind``: one of ``sources.INPUT_KINDS`` or ``auto`` (an indexed-dataset prefix, or what the first JSONL
    record's keys say); ``eod_loss``, ``prompt_loss``: ``sources.DocumentMasks``; ``split_documents``: the
    ``document`` layout splits a document longer than a row (else refuses it); ``num_samples``: the first rows
    only (None: all). Returns a row source (``TokenWindows`` or ``PlannedRows``).
    """
    kind = resolve_input_kind(data, input_kind, text_key=text_key)
    name = layout_name(kind, layout)
    source = RowInput(data=data, tokenizer=tokenizer, input_kind=kind, text_key=text_key,
                      masks=DocumentMasks(eod_loss=eod_loss, prompt_loss=prompt_loss),
                      split_documents=split_documents)
    return LAYOUTS[name].rows(source, seq_length, num_samples=num_samples)


__all__ = ["DEFAULT_LAYOUTS", "LAYOUTS", "RowInput", "layout_name", "open_rows"]
