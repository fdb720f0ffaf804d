"""Triton kernels of the chunked LM-head logprobs: one pass over a chunk's logits each way.

The PyTorch path of :mod:`~miles_multilora.scoring.chunked_logprobs` turns a chunk's ``[rows, vocab]``
logits into fp32, divides, masks, subtracts, exponentiates and sums in separate kernels, forward and
again backward (about 15 passes over ``rows x vocab`` fp32 values). These kernels read the GEMM's
logits (in the model dtype) once:

* :func:`row_stats`: per row, over this rank's vocab shard, the max ``m`` of ``z = logit / T``, the
  sum ``s`` of ``exp(z - m)`` and ``z`` at the row's target (0 when the target is in another shard),
  all in fp32 with an online max;
* :func:`softmax_grad_`: ``dz = (onehot(target) - exp(z - lse)) * g / T`` written over the logits in
  place, ready for the input-gradient GEMM.

Padded vocabulary ids (``>= valid`` columns of the shard) have probability 0, as in the PyTorch path.
Set ``TRITON_INTERPRET=1`` before import to run them on the CPU (tests).
"""

from __future__ import annotations

import torch

from miles_multilora._triton import HAVE_TRITON, tl, triton

BLOCK = 2048  # vocab columns per iteration


if HAVE_TRITON:

    @triton.jit
    def _row(logits_ptr, stride, targets_ptr, temp_ptr):
        """This program's row: its logits, temperature and target column."""
        row = tl.program_id(0)
        return (
            row,
            logits_ptr + row.to(tl.int64) * stride,
            tl.load(temp_ptr + row),
            tl.load(targets_ptr + row),
        )

    @triton.jit
    def _row_stats_kernel(
        logits_ptr, stride, targets_ptr, temp_ptr, max_ptr, sum_ptr, pick_ptr, valid, BLOCK: tl.constexpr
    ):
        row, base, t, target = _row(logits_ptr, stride, targets_ptr, temp_ptr)
        offs = tl.arange(0, BLOCK)
        m_vec = tl.full([BLOCK], -1.0e30, tl.float32)  # a lane that saw no column: exp(-1e30 - m) == 0
        s_vec = tl.zeros([BLOCK], tl.float32)
        pick = tl.zeros([BLOCK], tl.float32)
        for start in range(0, valid, BLOCK):
            cols = start + offs
            ok = cols < valid
            z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32) / t
            z = tl.where(ok, z, -1.0e30)
            new = tl.maximum(m_vec, z)
            s_vec = s_vec * tl.exp(m_vec - new) + tl.where(ok, tl.exp(z - new), 0.0)
            m_vec = new
            pick += tl.where(cols == target, z, 0.0)
        m = tl.max(m_vec, 0)
        tl.store(max_ptr + row, m)
        tl.store(sum_ptr + row, tl.sum(s_vec * tl.exp(m_vec - m), 0))
        tl.store(pick_ptr + row, tl.sum(pick, 0))

    @triton.jit
    def _softmax_grad_kernel(
        logits_ptr, stride, targets_ptr, temp_ptr, lse_ptr, grad_ptr, valid, n_cols, BLOCK: tl.constexpr
    ):
        row, base, t, target = _row(logits_ptr, stride, targets_ptr, temp_ptr)
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_ptr + row)
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            ok = cols < valid
            z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32) / t
            p = tl.where(ok, tl.exp(z - lse), 0.0)
            dz = (tl.where(cols == target, g, 0.0) - p * g) / t
            tl.store(base + cols, dz.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)


def row_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor, valid: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, s, z_target)`` per row of ``logits`` ``[n, V_local]`` (last dim contiguous): fp32 max of
    ``logit / T`` over the first ``valid`` columns, sum of ``exp(z - m)``, ``z`` at ``targets`` (local
    column ids; out of range gives 0)."""
    n = logits.shape[0]
    out = torch.empty(3, n, dtype=torch.float32, device=logits.device)
    if n:
        _row_stats_kernel[(n,)](
            logits, logits.stride(0), targets.contiguous(), temperature.contiguous(), out[0], out[1], out[2],
            valid, BLOCK=BLOCK,
        )  # fmt: skip
    return out[0], out[1], out[2]


def softmax_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    valid: int,
) -> torch.Tensor:
    """In place: ``logits`` becomes ``d logprob(target) / d logits * grad`` per row; returns it."""
    n = logits.shape[0]
    if n:
        _softmax_grad_kernel[(n,)](
            logits, logits.stride(0), targets.contiguous(), temperature.contiguous(), lse.contiguous(),
            grad.float().contiguous(), valid, logits.shape[1], BLOCK=BLOCK,
        )  # fmt: skip
    return logits
