"""The kernel checks of tests/kernel_checks.py, in a process where Triton can run them.

On CUDA (or when this process started with TRITON_INTERPRET=1) they run here. On CPU otherwise they run in a fresh
process with TRITON_INTERPRET=1 set before triton is imported: in this one, another module (megatron-core imports
triton at import time) may already have built triton.language's jitted helpers uninterpreted, and the interpreter
cannot call those.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpreter_active, run_module_interpreted

if interpreter_active():
    from tests.kernel_checks import *  # noqa: F401,F403  (pytest collects the imported test functions)
else:
    def test_kernel_checks_in_an_interpreter_process():
        run_module_interpreted("tests/test_kernels.py")

    def test_interpreter_switched_on_too_late_is_a_clear_error(monkeypatch):
        import triton.language  # noqa: F401  (built for compilation, as megatron-core's import does)

        from megatron_kd_plugin.kernels import chunk_row_stats

        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(RuntimeError, match="set after triton was imported"):
            chunk_row_stats(torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.int64), 1.0, kernels="triton")
