"""Rotary position embedding in one Triton kernel each way (training and prefill on a GPU).

Megatron's unfused RoPE (``t * cos + rotate_half(t) * sin``: a chunk, a negation, two
concatenations, two products and a sum) is about a dozen elementwise passes over q and k per layer,
forward and backward. Megatron calls a *fused* RoPE only through Transformer Engine; without TE that
hook is empty, and :func:`miles_multilora.models.compat.install_fused_rope` fills it with
:func:`apply_rope` on a GPU. Non-interleaved RoPE over the whole head with one position table for
the batch (``freqs`` ``[s, 1, 1, d]``); anything else runs Megatron's unfused function. The kernel
takes ``cos`` and ``sin`` of ``freqs`` itself (no per-call tables), rounded to the activation dtype
first, as Megatron does.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from miles_multilora._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def token_angles(freqs_ptr, stride_f, BATCH, HALF: tl.constexpr, dtype: tl.constexpr):
        """This program's token (``row = s * BATCH + b``): ``row, s, b`` (int64), the half-head lanes
        ``lo, hi`` and its angles' cos and sin for each half, rounded to the activation dtype (as
        Megatron rounds its tables) and widened to fp32, each ``[1, HALF]``."""
        row = tl.program_id(0)
        s = row // BATCH
        b = row % BATCH
        lo = tl.arange(0, HALF)
        hi = lo + HALF
        f_lo = tl.load(freqs_ptr + s * stride_f + lo).to(tl.float32)
        f_hi = tl.load(freqs_ptr + s * stride_f + hi).to(tl.float32)
        c_lo = tl.cos(f_lo).to(dtype).to(tl.float32)[None, :]
        c_hi = tl.cos(f_hi).to(dtype).to(tl.float32)[None, :]
        s_lo = tl.sin(f_lo).to(dtype).to(tl.float32)[None, :]
        s_hi = tl.sin(f_hi).to(dtype).to(tl.float32)[None, :]
        return row.to(tl.int64), s.to(tl.int64), b.to(tl.int64), lo, hi, c_lo, c_hi, s_lo, s_hi

    @triton.jit
    def _rope_kernel(
        x_ptr, freqs_ptr, out_ptr, stride_s, stride_b, stride_h, stride_f, BATCH,
        HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr, TRANSPOSE: tl.constexpr,
    ):  # fmt: skip
        """One token (``row = s * BATCH + b``), every head: the angles' cos and sin are taken once
        per token and shared by its heads."""
        dtype = out_ptr.dtype.element_ty
        row, s, b, lo, hi, c_lo, c_hi, s_lo, s_hi = token_angles(freqs_ptr, stride_f, BATCH, HALF, dtype)
        heads = tl.arange(0, HEADS_P2)[:, None]
        mask = heads < HEADS
        src = x_ptr + s * stride_s + b * stride_b + heads * stride_h
        x_lo = tl.load(src + lo[None, :], mask=mask).to(tl.float32)
        x_hi = tl.load(src + hi[None, :], mask=mask).to(tl.float32)
        if TRANSPOSE:  # the backward: the transposed rotation
            y_lo = x_lo * c_lo + x_hi * s_hi
            y_hi = x_hi * c_hi - x_lo * s_lo
        else:
            y_lo = x_lo * c_lo - x_hi * s_lo
            y_hi = x_hi * c_hi + x_lo * s_hi
        dst = out_ptr + (row * HEADS + heads) * (2 * HALF)
        tl.store(dst + lo[None, :], y_lo.to(dtype), mask=mask)
        tl.store(dst + hi[None, :], y_hi.to(dtype), mask=mask)


def _rotate(x: torch.Tensor, freqs: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x`` ``[s, b, h, d]`` rotated by ``freqs`` ``[s, d]`` (or by its transpose: the backward)."""
    seq, batch, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(seq, batch, heads, dim, dtype=x.dtype, device=x.device)
    _rope_kernel[(seq * batch,)](
        x, freqs, out, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0), batch,
        HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), HALF=dim // 2, TRANSPOSE=transpose,
    )  # fmt: skip
    return out


class _FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):  # type: ignore[override]
        ctx.save_for_backward(freqs)
        return _rotate(t, freqs, transpose=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (freqs,) = ctx.saved_tensors
        return _rotate(grad, freqs, transpose=True), None


def applies(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> bool:
    """Whether :func:`apply_rope`'s kernel handles ``t`` ``[s, b, h, d]`` with ``freqs``."""
    return (
        HAVE_TRITON
        and t.is_cuda
        and not interleaved
        and t.dim() == 4
        and rotates(freqs, t.shape[0], t.shape[-1])
    )


def rotates(freqs: torch.Tensor, seq: int, dim: int) -> bool:
    """Whether the kernels take ``freqs``: one ``[>= seq, 1, 1, dim]`` table for the whole batch,
    rotating whole heads of ``dim`` (whose half is a power of two: the kernels' lanes)."""
    return (
        freqs.dim() == 4
        and freqs.shape[0] >= seq
        and freqs.shape[1] == 1
        and freqs.shape[2] == 1
        and freqs.shape[-1] == dim
        and dim % 2 == 0
        and (dim // 2) & (dim // 2 - 1) == 0
    )


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's fused-RoPE hook: ``t`` ``[s, b, h, d]`` rotated by ``freqs`` ``[s, 1, 1, d]``."""
    if not applies(t, freqs, interleaved):
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    flat = freqs[: t.shape[0]].reshape(t.shape[0], -1)  # cos and sin are taken in the kernel
    return _FusedRoPE.apply(t, flat if flat.stride(-1) == 1 else flat.contiguous())
