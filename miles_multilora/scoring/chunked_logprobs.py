"""Token logprobs through the LM head without materialising fp32 ``[tokens, vocab]`` logits.

``log_softmax(h @ W^T / T)[target]`` for selected hidden rows, computed in chunks of rows: each
chunk's logits exist only inside the chunk, so peak memory is ``chunk x vocab`` instead of ``tokens
x vocab`` (3.7 GB in fp32 for 16 sequences of 400 tokens at a 152k vocabulary); with a gradient to
take, the forward takes each row's input gradient from the same logits, so they are computed once.
Each rank reduces its vocab shard ``W`` to three numbers per row (max, sum of exponentials, target
logit); under tensor parallelism those are combined across ranks, and the
input gradient is all-reduced (what Megatron's column-parallel output layer does around its GEMM).
On a CUDA device the per-chunk reductions are the fused Triton kernels of :mod:`logprob_kernels`
(one pass over the logits each way), elsewhere PyTorch ops. The numbers equal
:func:`~miles_multilora.scoring.temperature.token_logprobs` of the full logits up to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from miles_multilora.models.compat import lm_head_logits
from miles_multilora.scoring import logprob_kernels

DEFAULT_CHUNK_ROWS = 1024
FUSED = True  # the Triton reductions on CUDA devices; tests and benchmarks switch it off to compare


def _tp_group() -> tuple[object | None, int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    group = parallel_state.get_tensor_model_parallel_group()
    return (
        group,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _all_reduce(t: Tensor, op: dist.ReduceOp, group: object | None, size: int) -> Tensor:
    if size > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size, chunk, fused, eager_grad):  # type: ignore[override]
        group, size, rank = _tp_group()
        local = weight.shape[0]
        start = rank * local
        valid = max(0, min(local, vocab_size - start))  # this shard's real (unpadded) vocab columns
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        # d logprob / d hidden of each row, taken here from the logits at hand (see chunked_token_logprobs)
        row_grad = torch.empty_like(hidden) if eager_grad else None
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            local_t = targets[lo:hi] - start
            if fused:
                z = lm_head_logits(hidden[lo:hi], weight)
                m, s, picked = logprob_kernels.row_stats(z, local_t, temperature[lo:hi], valid)
            else:
                z = _logits(hidden[lo:hi], weight, temperature[lo:hi], valid)
                m, s, picked = _row_stats(z, local_t, local)
            if size > 1:  # combine the shards: global max, rescaled sums, the one shard's target logit
                m_all = _all_reduce(m.clone(), dist.ReduceOp.MAX, group, size)
                s = _all_reduce(s * torch.exp(m - m_all), dist.ReduceOp.SUM, group, size)
                mine = (local_t >= 0) & (local_t < local)
                picked = _all_reduce(torch.where(mine, picked, 0.0), dist.ReduceOp.SUM, group, size)
                m = m_all
            lse = m + torch.log(s)
            out[lo:hi] = picked - lse
            if row_grad is not None:
                if fused:  # in place on the logits
                    ones = torch.ones_like(lse)
                    dz = logprob_kernels.softmax_grad_(z, local_t, temperature[lo:hi], lse, ones, valid)
                else:
                    dz = _logit_grad(z, temperature[lo:hi], local_t, lse)
                row_grad[lo:hi] = dz.to(hidden.dtype) @ weight  # this shard's part (summed in backward)
        ctx.save_for_backward(row_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (row_grad,) = ctx.saved_tensors
        if row_grad is None:
            raise RuntimeError("chunked logprobs computed without a gradient (under no_grad) got a backward")
        group, size, _ = _tp_group()
        grad_hidden = torch.empty_like(row_grad)
        torch.mul(row_grad, grad_out.unsqueeze(1), out=grad_hidden)  # in fp32, rounded once
        _all_reduce(grad_hidden, dist.ReduceOp.SUM, group, size)
        return grad_hidden, None, None, None, None, None, None, None


def _logits(hidden: Tensor, weight: Tensor, temperature: Tensor, valid: int) -> Tensor:
    """fp32 tempered logits of this rank's vocab shard, padded columns (``>= valid``) at -inf."""
    z = lm_head_logits(hidden, weight) / temperature.unsqueeze(-1)
    return z.masked_fill(torch.arange(weight.shape[0], device=z.device) >= valid, float("-inf"))


def _row_stats(z: Tensor, local_t: Tensor, local: int) -> tuple[Tensor, ...]:
    """PyTorch twin of :func:`logprob_kernels.row_stats` on :func:`_logits` ``z`` (max, sum of
    exp, target logit or 0)."""
    m = z.max(-1).values.clamp(min=-1.0e30)  # a shard of padding only: s = 0, not nan (as the kernel)
    s = torch.exp(z - m.unsqueeze(-1)).sum(-1)
    mine = (local_t >= 0) & (local_t < local)
    picked = z.gather(-1, local_t.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    return m, s, torch.where(mine, picked, 0.0)


def _logit_grad(z: Tensor, temperature: Tensor, local_t: Tensor, lse: Tensor) -> Tensor:
    """PyTorch twin of :func:`logprob_kernels.softmax_grad_` with a unit gradient, on :func:`_logits`
    ``z``: ``(onehot - p) / T``, fp32."""
    dz = -torch.exp(z - lse.unsqueeze(-1))  # d lp / d z = onehot - p
    local = z.shape[-1]
    mine = ((local_t >= 0) & (local_t < local)).to(dz.dtype)
    dz.scatter_add_(-1, local_t.clamp(0, local - 1).unsqueeze(-1), mine.unsqueeze(-1))
    return dz / temperature.unsqueeze(-1)


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: Tensor,
    vocab_size: int,
    chunk: int = DEFAULT_CHUNK_ROWS,
    fused: bool | None = None,
) -> Tensor:
    """``log_softmax(hidden @ weight^T / T)[target]`` per row: ``hidden`` ``[N, H]``, ``weight`` this
    rank's ``[V_local, H]`` LM-head shard (frozen: no gradient is returned for it), ``targets`` ``[N]``
    global ids, ``temperature`` ``[N]`` (greedy rows already mapped to 1). Differentiable in ``hidden``.
    ``fused``: the Triton kernels of :mod:`logprob_kernels` (default: on a CUDA device).

    With a gradient to take, the forward also takes ``d logprob / d hidden`` of every row while its
    chunk's logits are at hand (``(onehot - p) / T`` times the LM head: one more GEMM per chunk), and
    the backward only scales those rows by the incoming gradient: the logits are computed once, not
    again in the backward. What is kept for the backward is that one ``[N, H]`` tensor."""
    if weight.requires_grad:
        raise ValueError("chunked logprobs need a frozen LM head (no gradient is computed for its weight)")
    if fused is None:
        fused = FUSED and logprob_kernels.HAVE_TRITON and hidden.is_cuda
    eager_grad = hidden.requires_grad and torch.is_grad_enabled()
    return _ChunkedLogprobs.apply(
        hidden, weight, targets.long(), temperature.float(), vocab_size, chunk, bool(fused), eager_grad
    )


def _gather(t: Tensor, group: object | None, size: int) -> Tensor:
    """Every TP rank's ``t`` stacked along a new first dimension."""
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


@torch.no_grad()
def chunked_topk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    temperature: Tensor,
    vocab_size: int,
    k: int,
    chunk: int = DEFAULT_CHUNK_ROWS,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely token ids of ``log_softmax(hidden @ weight^T / T)`` per row, highest
    first, and their fp32 logprobs: two ``[N, k]`` tensors (ids global, ``long``). No gradient.
    Shapes as :func:`chunked_token_logprobs`; under tensor parallelism each rank offers the ``k``
    best of its vocab shard and the log-sum-exp is combined across ranks."""
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in 1..{vocab_size} (the vocabulary), got {k}")
    group, size, rank = _tp_group()
    local = weight.shape[0]
    start = rank * local
    valid = max(0, min(local, vocab_size - start))
    ids = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    out = torch.empty(hidden.shape[0], k, dtype=torch.float32, device=hidden.device)
    for lo in range(0, hidden.shape[0], chunk):
        hi = min(lo + chunk, hidden.shape[0])
        z = _logits(hidden[lo:hi], weight, temperature[lo:hi], valid)  # padding columns at -inf
        lse = torch.logsumexp(z, dim=-1)
        values, index = z.topk(min(k, local), dim=-1)
        index = index + start
        if size > 1:  # the best of every shard's best; a padding-only shard offers -inf
            lse = torch.logsumexp(_gather(lse, group, size), dim=0)
            values = torch.cat(_gather(values, group, size).unbind(0), dim=-1)
            index = torch.cat(_gather(index, group, size).unbind(0), dim=-1)
            values, pick = values.topk(k, dim=-1)
            index = index.gather(-1, pick)
        out[lo:hi] = values - lse.unsqueeze(-1)
        ids[lo:hi] = index
    return ids, out
