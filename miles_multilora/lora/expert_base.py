"""The frozen base GEMMs of an MoE layer's local experts, over rows sorted by expert.

The experts' weights of one projection are kept as one ``[E, out, in]`` tensor whose slices the
experts' own parameters are (so Megatron's modules, state dicts and the bridge's weight loading
still see one parameter per expert, and no weight memory is doubled). On a GPU in bf16 one
grouped GEMM (``torch._grouped_mm``) runs every expert; its group offsets are a device tensor,
so a decode step needs no host sync. Elsewhere a loop over the experts' row segments, or (a
captured decode step outside bf16) one batched GEMM over each row's gathered expert weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_multilora.lora.kernels import grouped_mm_supported


def stack_weights(linears: list[nn.Module], name: str = "weight") -> torch.Tensor | None:
    """Move the parameters ``name`` of ``linears`` into one ``[E, ...]`` tensor; each module's parameter
    becomes a view of its slice. Returns the stack (None when the modules have no such parameter)."""
    first = getattr(linears[0], name, None)
    if first is None:
        return None
    stacked = torch.empty(len(linears), *first.shape, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for e, linear in enumerate(linears):
            param = getattr(linear, name)
            stacked[e].copy_(param.detach())
            param.data = stacked[e]
    return stacked


def holds(stacked: torch.Tensor | None, linears: list[nn.Module], name: str = "weight") -> bool:
    """Whether ``stacked`` still holds the modules' parameters (a ``model.to`` replaces them)."""
    if stacked is None:
        return False
    ends = (linears[0], linears[-1]), (stacked[0], stacked[-1])
    return all(
        getattr(m, name).data_ptr() == s.data_ptr() and getattr(m, name).dtype == s.dtype
        for m, s in zip(*ends, strict=True)
    )


class _GroupedLinear(torch.autograd.Function):
    """``y[seg_e] = x[seg_e] @ W[e]^T`` with a frozen ``W`` (only the input gets a gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight, offsets)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        weight, offsets = ctx.saved_tensors
        return torch._grouped_mm(grad.contiguous(), weight, offs=offsets), None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int] | None,
    offsets: torch.Tensor | None = None,
    row_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[T, in]`` sorted by expert, ``weight`` ``[E, out, in]`` -> ``[T, out]``.

    ``offsets``: int32 cumulative rows per expert on the device (the grouped GEMM, CUDA bf16);
    ``counts``: rows per expert on the host (the loop); with neither, ``row_experts`` ``[T]`` (each
    row's expert, on the device) gathers every row's weight (no host sync, for captured steps).
    """
    if offsets is not None and grouped_mm_supported(x, weight):
        return _GroupedLinear.apply(x.contiguous(), weight, offsets)
    if counts is not None:
        pieces = [F.linear(part, weight[e]) for e, part in enumerate(x.split(counts)) if counts[e]]
        # no rows: still a function of ``x``, so that the backward runs the token exchange that
        # brought them (every expert-parallel rank must join it, with rows or without)
        return torch.cat(pieces) if pieces else F.linear(x, weight[0])
    assert row_experts is not None, "grouped_linear needs offsets, counts or row_experts"
    return torch.bmm(weight.index_select(0, row_experts), x.unsqueeze(-1)).squeeze(-1)


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 cumulative rows per expert (the grouped GEMM's ``offs``), on ``counts``' device."""
    return counts.cumsum(0).to(torch.int32)
