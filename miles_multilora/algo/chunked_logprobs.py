"""Token logprobs through the LM head without materialising fp32 ``[tokens, vocab]`` logits.

``log_softmax(h @ W^T / T)[target]`` for selected hidden rows, computed in chunks of rows: each
chunk's logits exist only inside the chunk (forward and, recomputed, backward), so peak memory is
``chunk x vocab`` instead of ``tokens x vocab`` (3.7 GB in fp32 for 16 sequences of 400 tokens at
a 152k vocabulary). Under tensor parallelism ``W`` is this rank's vocab shard: the max, the sum of
exponentials and the target logit are all-reduced, and the input gradient too (what Megatron's
column-parallel output layer does around its GEMM). The numbers equal
:func:`~miles_multilora.rollout.sampling.token_logprobs` of the full logits up to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK_ROWS = 1024


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
    def forward(ctx, hidden, weight, targets, temperature, vocab_size, chunk):  # type: ignore[override]
        group, size, rank = _tp_group()
        local = weight.shape[0]
        start = rank * local
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty_like(out)
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            z = _logits(hidden[lo:hi], weight, temperature[lo:hi], start, vocab_size)
            m = _all_reduce(z.max(-1).values, dist.ReduceOp.MAX, group, size)
            s = _all_reduce(torch.exp(z - m.unsqueeze(-1)).sum(-1), dist.ReduceOp.SUM, group, size)
            lse = m + torch.log(s)
            local_t = targets[lo:hi] - start
            mine = (local_t >= 0) & (local_t < local)
            picked = z.gather(-1, local_t.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
            picked = _all_reduce(
                torch.where(mine, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group, size
            )
            out[lo:hi] = picked - lse
            lse_all[lo:hi] = lse
        ctx.save_for_backward(hidden, weight, targets, temperature, lse_all)
        ctx.vocab_size, ctx.chunk = vocab_size, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, targets, temperature, lse_all = ctx.saved_tensors
        group, size, rank = _tp_group()
        local = weight.shape[0]
        start = rank * local
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for lo in range(0, hidden.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, hidden.shape[0])
            z = _logits(hidden[lo:hi], weight, temperature[lo:hi], start, ctx.vocab_size)
            g = grad_out[lo:hi].float()
            dz = torch.exp(z - lse_all[lo:hi].unsqueeze(-1)) * (-g).unsqueeze(-1)  # d lp / d z = onehot - p
            local_t = targets[lo:hi] - start
            mine = (local_t >= 0) & (local_t < local)
            dz.scatter_add_(
                -1, local_t.clamp(0, local - 1).unsqueeze(-1), torch.where(mine, g, 0.0).unsqueeze(-1)
            )
            dz = dz / temperature[lo:hi].unsqueeze(-1)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = dz.to(hidden.dtype) @ weight
        if grad_hidden is not None:
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group, size)
        return grad_hidden, None, None, None, None, None


def _logits(hidden: Tensor, weight: Tensor, temperature: Tensor, start: int, vocab_size: int) -> Tensor:
    """fp32 tempered logits of this rank's vocab shard, padded ids (``>= vocab_size``) at -inf."""
    z = (hidden @ weight.t()).float() / temperature.unsqueeze(-1)
    ids = torch.arange(start, start + weight.shape[0], device=z.device)
    return z.masked_fill(ids >= vocab_size, float("-inf"))


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: Tensor,
    vocab_size: int,
    chunk: int = DEFAULT_CHUNK_ROWS,
) -> Tensor:
    """``log_softmax(hidden @ weight^T / T)[target]`` per row: ``hidden`` ``[N, H]``, ``weight`` this
    rank's ``[V_local, H]`` LM-head shard (frozen: no gradient is returned for it), ``targets`` ``[N]``
    global ids, ``temperature`` ``[N]`` (greedy rows already mapped to 1). Differentiable in ``hidden``."""
    if weight.requires_grad:
        raise ValueError("chunked logprobs need a frozen LM head (no gradient is computed for its weight)")
    return _ChunkedLogprobs.apply(hidden, weight, targets.long(), temperature.float(), vocab_size, chunk)
