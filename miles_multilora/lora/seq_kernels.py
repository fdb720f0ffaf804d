"""Per-sequence LoRA matmuls on Megatron's sequence-first activations, without layout copies.

When every sequence of a micro-batch has one slot, the LoRA of sequence ``b`` is two small GEMMs
with that sequence's ``A_b`` / ``B_b``. Activations are ``[seq, batch, hidden]``; seen as
``[batch, seq, hidden]`` they are strided views that cuBLAS reads and writes directly (leading
dimension ``batch * hidden``). So no activation is ever transposed into a new tensor:

* ``shrink``: ``h[b] = x[:, b] @ A_b^T`` -> ``[batch, seq, R]`` (small); its backward writes
  ``dx`` straight into sequence-first memory, so it adds to the base layer's ``dx`` with a
  contiguous, vectorised add;
* ``expand_add_``: ``out[:, b] += h[b] @ B_b^T`` in place through ``baddbmm_`` on the strided
  view: the LoRA output is accumulated by the GEMM itself (beta = 1), no separate add.
"""

from __future__ import annotations

import torch


def _batch_major(t: torch.Tensor, seq_first: bool) -> torch.Tensor:
    """``t`` seen as [batch, seq, features] (a strided view when it is sequence-first)."""
    return t.transpose(0, 1) if seq_first else t


class _SeqShrink(torch.autograd.Function):
    """``x`` [S, B, K] (or [B, S, K]), ``a`` [B, R, K] -> ``h`` [B, S, R]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, seq_first: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, a)
        ctx.seq_first = seq_first
        return torch.bmm(_batch_major(x, seq_first), a.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):  # type: ignore[override]
        x, a = ctx.saved_tensors
        grad_x = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
            torch.bmm(grad_h, a, out=_batch_major(grad_x, ctx.seq_first))  # written in x's memory order
        if ctx.needs_input_grad[1]:
            grad_a = torch.bmm(grad_h.transpose(1, 2), _batch_major(x, ctx.seq_first))
        return grad_x, grad_a, None


def shrink(x: torch.Tensor, a: torch.Tensor, seq_first: bool = True) -> torch.Tensor:
    """``h[b, s] = x[s, b] @ a[b]^T`` (``x`` [S, B, K] when ``seq_first`` else [B, S, K]; ``a`` [B, R, K])."""
    return _SeqShrink.apply(x, a, seq_first)


class _SeqExpandAdd(torch.autograd.Function):
    """``out`` [S, B, M] (or [B, S, M]) += ``h`` [B, S, R] @ ``b`` [B, M, R]^T in place, with its own
    backward (an in-place op on an autograd view would copy the whole activation in backward)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, seq_first: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, b)
        ctx.seq_first = seq_first
        _batch_major(out, seq_first).baddbmm_(h, b.transpose(1, 2))
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        h, b = ctx.saved_tensors
        grad_sf = _batch_major(grad_out, ctx.seq_first)  # [B, S, M] (strided) view, read by the GEMMs
        grad_h = torch.bmm(grad_sf, b) if ctx.needs_input_grad[1] else None
        grad_b = torch.bmm(grad_sf.transpose(1, 2), h) if ctx.needs_input_grad[2] else None
        return grad_out, grad_h, grad_b, None


def expand_add_(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, seq_first: bool = True) -> torch.Tensor:
    """``out[s, b] += h[b, s] @ b[b]^T`` in place (``out`` [S, B, M] or [B, S, M]; ``h`` [B, S, R]; ``b`` [B, M, R])."""
    return _SeqExpandAdd.apply(out, h, b, seq_first)
