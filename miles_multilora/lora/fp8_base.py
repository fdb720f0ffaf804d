"""An FP8 copy of a frozen base weight, and the base GEMMs that run on it (``model.base_precision=fp8``).

The base never changes, so its FP8 copies are made once: ``W`` ``[N, K]`` in e4m3 with one scale per
output channel (the forward's ``x @ W^T``), and ``W^T`` ``[K, N]`` with one scale per input channel
(the input gradient's ``dy @ W``). Each GEMM quantizes its activation per row (one scale per token),
so a token's result does not depend on the other rows of its batch: training, prefill and decode
compute the same numbers for it, as in bf16. ``torch._scaled_mm`` multiplies with the scales applied
and writes the activation's dtype. The LoRA terms stay in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_multilora._triton import HAVE_TRITON, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
_TINY = 1e-12  # an all-zero row gets this amax: its scale stays finite and its values 0
_ROW_BLOCK = 8192  # columns a program holds at once (wider rows run in two passes)


@dataclass
class Fp8Weight:
    """The two FP8 copies of one frozen weight ``W`` ``[N, K]`` and their fp32 scales."""

    fwd: torch.Tensor  # [N, K] e4m3: W / fwd_scale per row
    fwd_scale: torch.Tensor  # [1, N]
    bwd: torch.Tensor  # [K, N] e4m3: W^T / bwd_scale per row
    bwd_scale: torch.Tensor  # [1, K]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fwd, self.fwd_scale, self.bwd, self.bwd_scale))


if HAVE_TRITON:

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, n_cols, stride_x, BLOCK: tl.constexpr, MAX: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        src = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            amax = tl.maximum(amax, tl.abs(tl.load(src + cols, mask=cols < n_cols, other=0.0).to(tl.float32)))
        scale = tl.fdiv(tl.maximum(tl.max(amax, 0), 1e-12), MAX, ieee_rounding=True)  # as PyTorch divides
        inv = tl.fdiv(1.0, scale, ieee_rounding=True)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            v = tl.load(src + cols, mask=cols < n_cols, other=0.0).to(tl.float32) * inv
            v = tl.minimum(tl.maximum(v, -MAX), MAX)
            tl.store(q_ptr + row * n_cols + cols, v.to(q_ptr.dtype.element_ty), mask=cols < n_cols)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, 1]``) with ``x ~= q * scale`` per row."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    if HAVE_TRITON and x.is_cuda:
        q = torch.empty(rows, cols, dtype=FP8, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        if rows:
            block = min(triton.next_power_of_2(cols), _ROW_BLOCK)
            _quantize_rows_kernel[(rows,)](
                x, q, scale, cols, x.stride(0), BLOCK=block, MAX=FP8_MAX, num_warps=8 if block >= 4096 else 4
            )
        return q, scale
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """The FP8 copies of a frozen ``weight`` ``[N, K]`` (see the module docstring)."""
    with torch.no_grad():
        fwd, fwd_scale = quantize_rows(weight)
        bwd, bwd_scale = quantize_rows(weight.t().contiguous())
    return Fp8Weight(fwd, fwd_scale.view(1, -1), bwd, bwd_scale.view(1, -1))


def _scaled(x: torch.Tensor, q_t: torch.Tensor, scale_t: torch.Tensor) -> torch.Tensor:
    """``x @ (q_t * scale_t^T)^T`` with ``x`` quantized per row; ``q_t`` ``[N, K]`` row-major."""
    qx, sx = quantize_rows(x)
    return torch._scaled_mm(qx, q_t.t(), scale_a=sx, scale_b=scale_t, out_dtype=x.dtype)


def linear(x2d: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The forward GEMM ``x @ W^T`` on the FP8 copy: ``[M, K]`` -> ``[M, N]`` in ``x``'s dtype."""
    return _scaled(x2d, w.fwd, w.fwd_scale)


def input_grad(grad2d: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The input gradient ``dy @ W`` on the FP8 copy: ``[M, N]`` -> ``[M, K]`` in ``dy``'s dtype."""
    return _scaled(grad2d, w.bwd, w.bwd_scale)


class _Fp8Linear(torch.autograd.Function):
    """``x @ W^T`` of a frozen ``W`` through its FP8 copy, forward and input gradient."""

    @staticmethod
    def forward(ctx, x, w: Fp8Weight):  # type: ignore[override]
        ctx.w = w
        x2d = x.reshape(-1, x.shape[-1])
        return linear(x2d, w).view(*x.shape[:-1], w.fwd.shape[0])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g2d = grad.reshape(-1, grad.shape[-1])
        return input_grad(g2d, ctx.w).view(*grad.shape[:-1], ctx.w.bwd.shape[0]), None


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``x`` ``[..., K]`` times the frozen weight of ``w``, differentiable in ``x`` (base only, no LoRA)."""
    return _Fp8Linear.apply(x, w)
