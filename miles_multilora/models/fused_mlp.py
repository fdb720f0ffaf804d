"""Megatron's MLP with its SwiGLU as one Triton kernel each way (training on a GPU).

Megatron's unfused gated unit (``torch.chunk``, SiLU, product) runs three kernels forward and more
backward, and its autograd keeps ``linear_fc1``'s output *and* the SiLU output for the backward.
:class:`FusedSwiGLU` keeps only ``linear_fc1``'s output, computes ``silu(a) * b`` in one pass (the
decode kernel of :mod:`~miles_multilora.rollout.decode_fusions`) and both input gradients in
another. :class:`FusedMLP` uses it where :func:`~miles_multilora.rollout.decode_fusions.silu_gated_mlp`
allows (SiLU-gated, no bias, clamp or offset) and the activations are on a CUDA device; anything
else runs Megatron's MLP unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.mlp import MLP

from miles_multilora._triton import HAVE_TRITON, tl, triton
from miles_multilora.rollout import decode_fusions

BLOCK = 1024

if HAVE_TRITON:

    @triton.jit
    def _swiglu_backward_kernel(x_ptr, g_ptr, dx_ptr, F_DIM, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < F_DIM
        a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * stride_x + F_DIM + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * F_DIM + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-a))
        da = g * b * sig * (1.0 + a * (1.0 - sig))  # d silu(a) / da = sig * (1 + a * (1 - sig))
        db = g * a * sig
        tl.store(dx_ptr + row * 2 * F_DIM + offs, da.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + row * 2 * F_DIM + F_DIM + offs, db.to(dx_ptr.dtype.element_ty), mask=mask)


class FusedSwiGLU(torch.autograd.Function):
    """``silu(x[..., :F]) * x[..., F:]``; saves ``x`` only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()  # a no-op for linear_fc1's output
        ctx.save_for_backward(x)
        return decode_fusions.swiglu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        two_f = x.shape[-1]
        rows = x.reshape(-1, two_f)
        g = grad.reshape(rows.shape[0], two_f // 2).contiguous()
        dx = torch.empty_like(rows)
        grid = (rows.shape[0], triton.cdiv(two_f // 2, BLOCK))
        _swiglu_backward_kernel[grid](rows, g, dx, two_f // 2, rows.stride(0), BLOCK=BLOCK)
        return dx.view(x.shape)


class FusedMLP(MLP):
    """Megatron's MLP whose SiLU-gated activation is :class:`FusedSwiGLU` when it applies."""

    fused = True  # tests and benchmarks switch it off to compare with Megatron's path

    @functools.cached_property
    def fusable(self) -> bool:
        return HAVE_TRITON and decode_fusions.silu_gated_mlp(self)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Any = None, **kwargs: Any):  # type: ignore[override]
        if not (self.fused and per_token_scale is None and self.fusable and hidden_states.is_cuda):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, _ = self.linear_fc1(hidden_states)  # no bias: silu_gated_mlp checked it
        return self.linear_fc2(FusedSwiGLU.apply(intermediate))


def use_fused_mlp(model: torch.nn.Module) -> None:
    """Make every dense Megatron ``MLP`` of ``model`` a :class:`FusedMLP` (same state, one more path).

    Done on the built model rather than in the layer spec: Megatron's layer gives its process group
    only to modules that are exactly ``MLP``."""
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = FusedMLP
