"""Segmented (grouped) matmul over slot-sorted tokens: ``y[seg_s] = x[seg_s] @ W[s]^T``.

Two backends behind one autograd function:

* CUDA + bf16/fp16: ``torch._grouped_mm`` with the plan's cumulative offsets, forward and backward
  (no host syncs, no per-slot Python loop; empty slots get an exact zero weight gradient).
* everything else (CPU, fp32): an exact loop over the *non-empty* segments only.
"""

from __future__ import annotations

import torch

from miles_multilora.lora.routing import RoutingPlan

_GROUPED_DTYPES = (torch.bfloat16,)


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the grouped-GEMM kernel applies (CUDA, bf16, 16-byte aligned rows)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype in _GROUPED_DTYPES):
        return False
    align = 16 // x.element_size()
    return weight.shape[-1] % align == 0 and weight.shape[-2] % align == 0


def _grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets)


class SegmentedMatmul(torch.autograd.Function):
    """``x`` [T, K] sorted by slot, ``weight`` [N, M, K] -> [T, M]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        # the grouped GEMM takes groups in weight order: a plan in another order loops
        ctx.use_grouped = grouped_mm_supported(x, weight) and plan.segment_slots is None
        ctx.save_for_backward(x, weight)
        if ctx.use_grouped:
            return _grouped(x, weight.transpose(-2, -1), plan.offsets)
        y = x.new_empty(x.shape[0], weight.shape[1])
        for slot, start, end in plan.segments():
            torch.matmul(x[start:end], weight[slot].t(), out=y[start:end])
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        plan: RoutingPlan = ctx.plan
        grad_x = grad_w = None
        grad_y = grad_y.contiguous()
        if ctx.use_grouped:
            if ctx.needs_input_grad[0]:
                grad_x = _grouped(grad_y, weight, plan.offsets)
            if ctx.needs_input_grad[1]:
                grad_w = _grouped(grad_y.t(), x, plan.offsets)  # [N, M, K]
                nonempty = torch.diff(plan.offsets, prepend=plan.offsets.new_zeros(1)) > 0
                grad_w = torch.where(nonempty[:, None, None], grad_w, torch.zeros_like(grad_w))
            return grad_x, grad_w, None
        if ctx.needs_input_grad[0]:
            grad_x = x.new_zeros(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight)
        for slot, start, end in plan.segments():
            gy = grad_y[start:end]
            if grad_x is not None:
                torch.matmul(gy, weight[slot], out=grad_x[start:end])
            if grad_w is not None:
                torch.matmul(gy.t(), x[start:end], out=grad_w[slot])
        return grad_x, grad_w, None


def segmented_matmul(x: torch.Tensor, weight: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """``y[seg_s] = x[seg_s] @ weight[s]^T`` for the plan's slot segments (autograd-aware)."""
    return SegmentedMatmul.apply(x, weight, plan)


class _GatherRows(torch.autograd.Function):
    """``x[index]`` whose backward scatters with a plain copy (indices are unique: no atomics)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.num_rows, grad.shape[1])
        return out.index_copy_(0, index, grad), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``x[index]`` for unique ``index`` (the routed tokens), with a sync-free, atomic-free backward."""
    return _GatherRows.apply(x, index)


class _AddRowsInPlace(torch.autograd.Function):
    """Token rows ``out[index] += delta`` in place (``out`` [..., H] contiguous, flattened to rows).

    Unique ``index``: a gather, an add and a plain copy (no atomics, no autograd copy of ``out``).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        rows = out.view(-1, out.shape[-1])
        rows.index_copy_(0, index, rows.index_select(0, index).add_(delta))
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad, None, grad.reshape(-1, grad.shape[-1]).index_select(0, index)


def add_rows_(out: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """In-place ``out.view(-1, H)[index] += delta`` (unique ``index``), autograd-aware; returns ``out``."""
    return _AddRowsInPlace.apply(out, index, delta)
