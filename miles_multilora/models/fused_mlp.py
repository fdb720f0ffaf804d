"""Megatron's MLP with its SwiGLU as one Triton kernel each way (training on a GPU).

Megatron's unfused gated unit (``torch.chunk``, SiLU, product) runs three kernels forward and more
backward, and its autograd keeps ``linear_fc1``'s output *and* the SiLU output for the backward.
:class:`FusedSwiGLU` keeps only ``linear_fc1``'s output, computes ``silu(a) * b`` in one pass (the
kernel the embedded engine's decode steps use too) and both input gradients in
another. :class:`FusedMLP` uses it where :func:`silu_gated_mlp` allows (SiLU-gated, no bias, clamp
or offset) and the activations are on a CUDA device; anything else runs Megatron's MLP unchanged.
The forward kernel also takes a per-row additive term (a decode step's deferred LoRA output, see
:func:`~miles_multilora.rollout.decode_fusions.swiglu`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from miles_multilora._triton import HAVE_TRITON, tl, triton

BLOCK = 1024

if HAVE_TRITON:

    @triton.jit
    def _swiglu_kernel(
        x_ptr, out_ptr, lora_ptr, slots_ptr, F_DIM, stride_x, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < F_DIM
        a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        b = tl.load(x_ptr + row * stride_x + F_DIM + offs, mask=mask, other=0.0)
        if HAS_LORA:  # fc1's output plus its row's LoRA term, rounded as the in-place expand
            lmask = mask & (tl.load(slots_ptr + row) >= 0)
            a = (a.to(tl.float32) + tl.load(lora_ptr + row * 2 * F_DIM + offs, mask=lmask, other=0.0)).to(
                a.dtype
            )
            b = (
                b.to(tl.float32) + tl.load(lora_ptr + row * 2 * F_DIM + F_DIM + offs, mask=lmask, other=0.0)
            ).to(b.dtype)
        a = a.to(tl.float32)
        y = a / (1.0 + tl.exp(-a)) * b.to(tl.float32)
        tl.store(out_ptr + row * F_DIM + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

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


def silu_gated_mlp(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp`` is a SiLU-gated MLP that :func:`swiglu` can stand in for (no clamp, offset,
    bias or Megatron/TE activation fusion)."""
    cfg = getattr(mlp, "config", None)
    return (
        cfg is not None
        and bool(cfg.gated_linear_unit)
        and cfg.activation_func is F.silu
        and getattr(cfg, "activation_func_clamp_value", None) is None
        and not getattr(cfg, "glu_linear_offset", 0.0)
        and not getattr(cfg, "bias_activation_fusion", False)
        and not getattr(cfg, "add_bias_linear", False)
        and not getattr(cfg, "use_te_activation_func", False)
    )


def swiglu(
    x: torch.Tensor, delta: torch.Tensor | None = None, row_slots: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` for ``x`` ``[..., 2F]`` (Megatron's gated linear unit), one
    kernel. ``delta`` (fp32 ``[rows, 2F]``) is added to ``x`` first on the rows whose ``row_slots``
    entry is >= 0, rounded as an in-place add would round it."""
    two_f = x.shape[-1]
    rows = x.reshape(-1, two_f)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    f_dim = two_f // 2
    out = torch.empty(rows.shape[0], f_dim, dtype=x.dtype, device=x.device)
    _swiglu_kernel[(rows.shape[0], triton.cdiv(f_dim, BLOCK))](
        rows, out, delta if delta is not None else rows, row_slots if row_slots is not None else rows,
        f_dim, rows.stride(0), HAS_LORA=delta is not None, BLOCK=BLOCK,
    )  # fmt: skip
    return out.view(*x.shape[:-1], f_dim)


class FusedSwiGLU(torch.autograd.Function):
    """``silu(x[..., :F]) * x[..., F:]``; saves ``x`` only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()  # a no-op for linear_fc1's output
        ctx.save_for_backward(x)
        return swiglu(x)

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
        return HAVE_TRITON and silu_gated_mlp(self)

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
