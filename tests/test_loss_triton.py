"""The fused loss on the Triton kernels (tests/loss_triton_checks.py), in a process where Triton can run them.

On CUDA (or when this process started with TRITON_INTERPRET=1) the checks run here. On CPU otherwise they run in
ONE fresh process with TRITON_INTERPRET=1 set before triton is imported (tests/test_kernels.py says why).
"""

from __future__ import annotations


import pytest
import torch

from tests.triton_interpreter import interpreter_active, run_module_interpreted

if interpreter_active():
    from tests.loss_triton_checks import *  # noqa: F401,F403  (pytest collects the imported test functions)
else:
    def test_triton_fused_loss_in_an_interpreter_process():
        run_module_interpreted("tests/test_loss_triton.py")

    def test_kernels_triton_without_triton_runtime_is_a_clear_error():
        """CPU tensors without the interpreter: kernels='triton' refuses, kernels='auto' takes the PyTorch path."""
        from megatron_kd_plugin.loss import topk_kd_loss
        from tests.test_loss_helpers import make_case, teacher_of

        case = make_case(s=2, b=3, vocab=20, k=3, dtype=torch.float32)
        args = (case["hidden"], case["weight"], teacher_of(case))
        with pytest.raises(ValueError, match="kernels='triton' cannot run on cpu"):
            topk_kd_loss(*args, kernels="triton")
        auto = topk_kd_loss(*args, kernels="auto").loss_sum
        assert torch.equal(auto, topk_kd_loss(*args, kernels="torch").loss_sum)
