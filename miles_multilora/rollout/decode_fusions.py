"""Fused elementwise kernels of a decode step: residual add + RMSNorm, and SwiGLU.

At decode batch sizes a layer is launch-bound: Megatron's modules run the residual add, the
norm and the gated activation (a strided chunk, SiLU and a product) as separate kernels, each one
a full pass over the activations. Here ``add_rmsnorm`` writes the new residual (rounded to the
model dtype, as the unfused add is) and its normalised copy in one pass, and ``swiglu`` computes
``silu(a) * b`` of the two halves of ``linear_fc1``'s output in one. :func:`fusable` says which
modules they may stand in for (torch RMSNorm, SiLU-gated MLP without clamping, offsets or bias);
anything else runs the module itself. Both take the deferred LoRA term of the linear whose output
they read (:class:`~miles_multilora.lora.row_delta.RowDelta`) and add it as they load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_multilora._triton import HAVE_TRITON, tl, triton
from miles_multilora.lora.row_delta import RowDelta

if HAVE_TRITON:

    @triton.jit
    def _add_rmsnorm_kernel(
        res_ptr, delta_ptr, weight_ptr, res_out_ptr, norm_out_ptr, lora_ptr, slots_ptr, H, eps,
        HAS_DELTA: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * H + offs, mask=mask, other=0.0)
            if HAS_LORA:  # the linear's output plus its row's LoRA term, rounded as the in-place expand
                routed = tl.load(slots_ptr + row) >= 0
                lora = tl.load(lora_ptr + row * H + offs, mask=mask & routed, other=0.0)
                d = (d.to(tl.float32) + lora).to(delta_ptr.dtype.element_ty)
            x = x.to(tl.float32) + d.to(tl.float32)
            x = x.to(res_out_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
            tl.store(res_out_ptr + row * H + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(norm_out_ptr + row * H + offs, (xf * rstd * w).to(norm_out_ptr.dtype.element_ty), mask=mask)

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


def fusable(norm: torch.nn.Module, mlp: torch.nn.Module, device: torch.device) -> tuple[bool, bool]:
    """``(norm, mlp)``: whether ``add_rmsnorm`` / ``swiglu`` may replace these modules on ``device``."""
    if not (HAVE_TRITON and device.type == "cuda"):
        return False, False
    norm_ok = (
        type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps is not None
    )  # exact type: subclasses may change the math
    return norm_ok, silu_gated_mlp(mlp)


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


def add_rmsnorm(
    residual: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.RMSNorm, lora: RowDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, rmsnorm(residual + delta))``, the sum rounded to the model dtype first
    (``delta`` None: just the norm). ``lora``: ``delta``'s deferred LoRA term, added to it first.
    Shapes ``[..., H]``; one pass, one kernel."""
    if lora is not None and delta is None:
        raise ValueError("a LoRA term needs the output it belongs to (delta)")
    hidden = residual.shape[-1]
    x = residual.reshape(-1, hidden)
    rows = x.shape[0]
    res_out = torch.empty_like(x) if delta is not None else x
    norm_out = torch.empty_like(x)
    _add_rmsnorm_kernel[(rows,)](
        x, delta.reshape(-1, hidden) if delta is not None else x, norm.weight, res_out, norm_out,
        lora.delta if lora is not None else x, lora.row_slots if lora is not None else x,
        hidden, float(norm.eps), HAS_DELTA=delta is not None, HAS_LORA=lora is not None,
        BLOCK=triton.next_power_of_2(hidden), num_warps=4 if hidden <= 4096 else 8,
    )  # fmt: skip
    return res_out.view(residual.shape), norm_out.view(residual.shape)


def swiglu(x: torch.Tensor, lora: RowDelta | None = None) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` for ``x`` ``[..., 2F]`` (Megatron's gated linear unit);
    ``lora``: ``x``'s deferred LoRA term, added to it first."""
    two_f = x.shape[-1]
    rows = x.reshape(-1, two_f)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    f_dim = two_f // 2
    out = torch.empty(rows.shape[0], f_dim, dtype=x.dtype, device=x.device)
    block = 1024
    _swiglu_kernel[(rows.shape[0], triton.cdiv(f_dim, block))](
        rows, out, lora.delta if lora is not None else rows, lora.row_slots if lora is not None else rows,
        f_dim, rows.stride(0), HAS_LORA=lora is not None, BLOCK=block,
    )  # fmt: skip
    return out.view(*x.shape[:-1], f_dim)
