"""megatron-core's gradient-accumulation convention for the lm_head weight: dW goes straight into DDP's main_grad.

megatron-core's DDP gives every parameter ``main_grad`` (a view of its fp32 gradient buffer) and a flag
``grad_added_to_main_grad``; its backward hook adds ``param.grad`` into ``main_grad`` unless the flag is set, then
drops ``param.grad`` (``distributed_data_parallel.py``, ``_make_backward_post_hook``). Its own linear layers
(``LinearWithGradAccumulationAndAsyncCommunication`` with gradient_accumulation_fusion) accumulate dW into
``main_grad`` themselves, set the flag, and return a placeholder grad whose values are never read (an uninitialised
``torch.empty``; zeros when ``zero_out_wgrad`` marks a weight tied to the embedding, whose grad DDP does add).

The fused loss does the same, without apex and whatever ``gradient_accumulation_fusion`` says (it needs no fused
kernel): dW is accumulated in fp32 into ``main_grad``, never rounded to the weight's bf16 nor held in a second
[V/tp, H] buffer. Its placeholder costs no memory: a detached alias of the weight (DDP discards it unread), or None
for a tied weight (the embedding's grad is then ``param.grad``, which DDP adds), for a weight without the flag
(megatron's convention without DDP's hook), and when ``weight.grad`` is still set (nothing dropped the previous
placeholder: autograd would add the new one into it in place, i.e. into the weight).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MainGrad:
    """The weight and its ``main_grad`` buffer [V/tp, H] (the loss's accumulation dtype)."""

    weight: torch.Tensor
    """The lm_head weight (the Parameter itself, which carries DDP's attributes)."""
    buffer: torch.Tensor
    """``weight.main_grad``."""

    def placeholder_grad(self) -> torch.Tensor | None:
        """Mark dW as added (DDP then skips it) and return what backward returns for the weight."""
        if not hasattr(self.weight, "grad_added_to_main_grad"):
            return None
        self.weight.grad_added_to_main_grad = True
        if getattr(self.weight, "zero_out_wgrad", False) or self.weight.grad is not None:
            return None             # a grad still there (no DDP hook dropped it) would be accumulated in place
        return self.weight.detach()


def main_grad_of(weight: torch.Tensor, dtype: torch.dtype, enabled: bool) -> MainGrad | None:
    """``weight``'s main_grad when dW should be accumulated there: ``enabled``, the weight needs a gradient and has a
    ``main_grad`` of the loss's accumulation ``dtype`` (fp32; a bf16 main_grad is left to DDP: dW is returned) that
    is not Megatron-FSDP's (allocated lazily by its own hooks)."""
    buffer = getattr(weight, "main_grad", None)
    if (not enabled or buffer is None or not weight.requires_grad or buffer.dtype != dtype
            or hasattr(weight, "__fsdp_param__")):
        return None
    if buffer.shape != weight.shape:
        raise ValueError(f"weight.main_grad has shape {tuple(buffer.shape)}, the weight {tuple(weight.shape)}")
    return MainGrad(weight, buffer)
