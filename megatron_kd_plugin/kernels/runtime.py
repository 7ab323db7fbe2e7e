"""Where the per-chunk kernels can run: ``kernels="auto"|"triton"|"torch"`` resolved for a chunk's logits."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNELS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read at each launch)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(logits: torch.Tensor, kernels: str = "auto") -> bool:
    """Whether ``kernels`` selects the Triton path for these logits; ValueError if it is unknown or impossible."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: expected one of {KERNELS}")
    if kernels == "torch":
        return False
    runnable = triton_importable() and (logits.is_cuda or (interpreting() and logits.device.type == "cpu"))
    if kernels == "triton" and not runnable:
        raise ValueError(f"kernels='triton' cannot run on {logits.device} logits (triton importable: "
                         f"{triton_importable()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}): "
                         "use a CUDA device, TRITON_INTERPRET=1 on CPU, or kernels='auto'/'torch'")
    return runnable
