"""A decode step's LoRA output kept apart from the base output, for the kernel that consumes it.

On a GPU, a decode step's LoRA can leave the critical path in two forms
(:meth:`MultiLoRALinear.forward_deferred`):

* :class:`RowDelta`: few rows; the whole LoRA (shrink and expand) ran on a side stream while the
  base GEMM ran, into a separate fp32 buffer. The kernel that reads the linear's output next (RoPE
  + KV write, residual add + RMSNorm) adds it as it loads.
* :class:`RowShrink`: only the shrink ran (on the side stream, after the base GEMM, or inside it
  with a stacked weight, for many rows); the consumer (SwiGLU) runs the expand itself, per tile of rows of one slot, so the output
  is never read and written back by a separate expand and no fp32 buffer of the output's width
  exists.

Either way the consumer adds ``bf16(out + delta)``, the rounding of the in-place expand it
replaces. Rows of slot -1 were never written and must be skipped by slot, not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_multilora.lora import triton_kernels as tk
from miles_multilora.lora.row_routing import RowRouting


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


@dataclass(frozen=True)
class RowShrink:
    """The LoRA term as its shrink: row ``r``'s term is ``h[r] @ weight[slot]^T``.

    ``h`` is what the decode shrink left (:func:`~miles_multilora.lora.triton_kernels.split_shrink`'s
    scaled fp32 partials ``[parts, rows, R]``, or with ``dense_scale`` the dense shrink's unscaled
    ``[rows, slots * R]``); ``weight`` is the layer's ``lora_B`` ``[slots, out, R]``.
    """

    h: torch.Tensor
    weight: torch.Tensor
    plan: RowRouting
    dense_scale: torch.Tensor | None = None

    @property
    def row_slots(self) -> torch.Tensor:
        return self.plan.row_slots

    def add_to(self, out: torch.Tensor) -> torch.Tensor:
        """A copy of ``out`` with the term added to its routed rows (the separate in-place expand)."""
        result = out.contiguous().clone()
        tk.decode_expand(
            result.view(-1, result.shape[-1]), self.h, self.plan.order, self.plan.tiles, self.weight,
            accumulate=True, dense_scale=self.dense_scale,
        )  # fmt: skip
        return result
