"""A decode step's LoRA output kept apart from the base output, for the kernel that consumes it.

On a GPU, a decode step of few rows runs each layer's whole LoRA (shrink and expand) on a side
stream while the base GEMM runs, into a separate fp32 buffer (:meth:`MultiLoRALinear.forward_deferred`).
The kernel that reads the linear's output next (RoPE + KV write, SwiGLU, residual add + RMSNorm)
adds it as it loads: ``bf16(out + delta)``, the rounding of the in-place expand it replaces. Rows of
slot -1 were never written (their ``delta`` is garbage) and must be skipped by slot, not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowDelta:
    """``delta[r]`` (fp32, ``[rows, out]``) belongs to row ``r`` when ``row_slots[r] >= 0``."""

    delta: torch.Tensor
    row_slots: torch.Tensor

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` with the delta added to its routed rows, rounded once to ``out``'s dtype (the
        PyTorch fallback for a consumer without a fused kernel)."""
        flat = out.reshape(-1, out.shape[-1])
        routed = (self.row_slots >= 0).unsqueeze(1)
        summed = torch.where(routed, flat.float() + self.delta, flat.float())
        return summed.to(out.dtype).view(out.shape)
