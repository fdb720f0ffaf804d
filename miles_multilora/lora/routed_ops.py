"""Autograd ops of the Triton LoRA path: shrink with row gather, expand with in-place row scatter.

Forward of one layer: ``h = gather_shrink(x, A, scale)`` (``[num_routed, R]``, grouped by slot), the
layer's TP collective on ``h``, then ``scatter_expand_add_(out, h, B)`` adds ``h @ B_s^T`` into the
base output rows in place. No activation-sized tensor is gathered, scattered or copied; the
backward reads ``x`` and the output gradient once per GEMM and writes ``dx`` once.

The kernel schedules (tiles of one slot's grouped tokens, weight-gradient chunks) come from the
routing plan's host-side counts and are cached on the plan: built once per micro-batch, not per layer.
"""

from __future__ import annotations

import torch

from miles_multilora.host_tensors import to_device
from miles_multilora.lora import fp8_base
from miles_multilora.lora import triton_kernels as tk
from miles_multilora.lora.routing import RoutingPlan


def _split_segments(c: torch.Tensor, block: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Split each slot's segment of grouped tokens (``c``: tokens per slot) into pieces of at most
    ``block`` (one size, or one per slot)."""
    seg_start = c.cumsum(0) - c
    pieces = (c + block - 1) // block
    if isinstance(block, torch.Tensor):
        block = block.repeat_interleave(pieces)
    slot = torch.repeat_interleave(torch.arange(len(c)), pieces)
    first_piece = pieces.cumsum(0) - pieces
    local = torch.arange(int(pieces.sum())) - first_piece[slot]
    start = seg_start[slot] + local * block
    end = torch.minimum(start + block, seg_start[slot] + c[slot])
    return slot, start, end, pieces


def tile_schedule(plan: RoutingPlan, block_m: int, device: torch.device) -> torch.Tensor:
    """``[3, tiles]`` int32 (slot, start, end) for the shrink / expand kernels (cached on the plan)."""
    key = ("tiles", block_m, str(device))
    if key not in plan.schedules:
        counts, ids = plan.segment_counts()
        slot, start, end, _ = _split_segments(counts, block_m)
        slot = slot if ids is None else ids[slot]
        plan.schedules[key] = to_device(torch.stack([slot, start, end]).to(torch.int32), device)
    return plan.schedules[key]


def chunk_lengths(c: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Tokens per weight-gradient program for each slot: at most ``CHUNKS_PER_SLOT`` chunks of at
    least ``MIN_CHUNK`` tokens. A slot's chunking depends on its own token count only, so its
    gradient is summed in the same order whatever the other slots hold (co-training equals
    training alone). ``c``: tokens per slot."""
    block = cfg["BLOCK_T"]
    per_chunk = (c + cfg["CHUNKS_PER_SLOT"] - 1) // cfg["CHUNKS_PER_SLOT"]
    return torch.clamp((per_chunk + block - 1) // block * block, min=cfg["MIN_CHUNK"])


def weight_grad_schedule(
    plan: RoutingPlan, cfg: dict, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Chunks ``[4, n]`` (slot, start, end, partial index or -1 when the slot has one chunk),
    reductions ``[3, m]`` (slot, first partial, count) and the number of partials (cached on the plan)."""
    key = ("chunks", cfg["BLOCK_T"], cfg["MIN_CHUNK"], cfg["CHUNKS_PER_SLOT"], str(device))
    if key not in plan.schedules:
        counts, ids = plan.segment_counts()  # per segment of the grouped order
        slot, start, end, pieces = _split_segments(counts, chunk_lengths(counts, cfg))
        multi = pieces[slot] > 1
        dest = torch.full_like(slot, -1)
        dest[multi] = torch.arange(int(multi.sum()))
        # A slot without tokens gets one empty chunk: its program writes the zero gradient, so the
        # gradient buffer never needs a separate zero fill.
        empty = torch.nonzero(pieces == 0).flatten()
        none = torch.zeros_like(empty)
        slot, start = torch.cat([slot, empty]), torch.cat([start, none])
        end, dest = torch.cat([end, none]), torch.cat([dest, none - 1])
        red_slots = torch.nonzero(pieces > 1).flatten()
        red_count = pieces[red_slots]
        red_first = red_count.cumsum(0) - red_count
        if ids is not None:  # segments -> the slots (weights) they are
            slot, red_slots = ids[slot], ids[red_slots]
        chunks = to_device(torch.stack([slot, start, end, dest]).to(torch.int32), device)
        reductions = to_device(torch.stack([red_slots, red_first, red_count]).to(torch.int32), device)
        plan.schedules[key] = (chunks, reductions, int(multi.sum()))
    return plan.schedules[key]


def _tile_rows(plan: RoutingPlan, block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:func:`tile_schedule`'s rows, split once per plan (not at every launch)."""
    key = ("tile rows", block_m, device)
    if key not in plan.schedules:
        plan.schedules[key] = tile_schedule(plan, block_m, device).unbind(0)
    return plan.schedules[key]


def _weight_grad_rows(plan: RoutingPlan, cfg: dict, device: torch.device) -> tuple:
    """:func:`weight_grad_schedule` with its chunks and reductions split into rows once per plan."""
    key = ("chunk rows", cfg["BLOCK_T"], cfg["MIN_CHUNK"], cfg["CHUNKS_PER_SLOT"], device)
    if key not in plan.schedules:
        chunks, reductions, partials = weight_grad_schedule(plan, cfg, device)
        plan.schedules[key] = (chunks.unbind(0), reductions.unbind(0), partials)
    return plan.schedules[key]


def _weight_grad(
    p: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, strides, plan
) -> None:
    cfg = tk.launch_config(tk.WGRAD_CONFIGS, p.shape[1])
    chunks, reductions, partials = _weight_grad_rows(plan, cfg, p.device)
    tk.segment_weight_grad(p, x, rows, grad, strides, chunks, reductions, partials, cfg)


def _shrink(x, rows, weight, strides, rank: int, plan: RoutingPlan, scale=None) -> torch.Tensor:
    cfg = tk.launch_config(tk.SHRINK_CONFIGS, rank)
    tiles = _tile_rows(plan, cfg["BLOCK_M"], x.device)
    return tk.gather_shrink(x, rows, weight, strides, rank, tiles, cfg, plan.num_routed, scale)


def _expand(out, h, rows, weight, strides, plan: RoutingPlan, accumulate: bool) -> None:
    cfg = tk.launch_config(tk.EXPAND_CONFIGS, h.shape[1])
    tiles = _tile_rows(plan, cfg["BLOCK_M"], out.device)
    tk.scatter_expand(out, h, rows, weight, strides, tiles, cfg, accumulate)


class _GatherShrink(torch.autograd.Function):
    """``x`` [T, K], ``a`` [N, R, K], fp32 ``scale`` [N] -> ``h`` [num_routed, R] = scale_s * x[rows] @ A_s^T."""

    @staticmethod
    def forward(ctx, x, a, scale, plan: RoutingPlan, rows):  # type: ignore[override]
        h = _shrink(x, rows, a, (a.stride(0), a.stride(1), a.stride(2)), a.shape[1], plan, scale)
        ctx.save_for_backward(x, a, scale, rows)
        ctx.plan = plan
        return h

    @staticmethod
    def backward(ctx, grad_h):  # type: ignore[override]
        x, a, scale, rows = ctx.saved_tensors
        plan: RoutingPlan = ctx.plan
        row_scale = scale.index_select(0, plan.sorted_slots).unsqueeze(1)
        grad_z = (grad_h.float() * row_scale).to(x.dtype).contiguous()
        grad_x = grad_a = None
        if ctx.needs_input_grad[0]:
            full = plan.num_routed == x.shape[0]
            grad_x = torch.empty_like(x) if full else torch.zeros_like(x)
            # dx[rows[i]] = grad_z[i] @ A_s: W[s][r, k] = A[s, r, k]
            _expand(grad_x, grad_z, rows, a, (a.stride(0), a.stride(2), a.stride(1)), plan, accumulate=False)
        if ctx.needs_input_grad[1]:
            grad_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)  # every slot is written
            _weight_grad(
                grad_z, x, rows, grad_a, (grad_a.stride(0), grad_a.stride(1), grad_a.stride(2)), plan
            )
        return grad_x, grad_a, None, None, None


class _ScatterExpandAdd(torch.autograd.Function):
    """``out`` [T, M] (any shape with T*M elements, contiguous) += h[i] @ B_s^T at rows[i], in place."""

    @staticmethod
    def forward(ctx, out, h, b, plan: RoutingPlan, rows):  # type: ignore[override]
        out2d = out.view(-1, out.shape[-1])
        _expand(out2d, h, rows, b, (b.stride(0), b.stride(1), b.stride(2)), plan, accumulate=True)
        ctx.mark_dirty(out)
        ctx.save_for_backward(h, b, rows)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        h, b, rows = ctx.saved_tensors
        plan: RoutingPlan = ctx.plan
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        if g2d.stride(-1) != 1:
            g2d = g2d.contiguous()
        grad_h = grad_b = None
        b_t = (b.stride(0), b.stride(2), b.stride(1))  # B[s] seen as [R, M]
        if ctx.needs_input_grad[1]:
            grad_h = _shrink(g2d, rows, b, b_t, b.shape[2], plan)
        if ctx.needs_input_grad[2]:
            grad_b = torch.empty(b.shape, dtype=b.dtype, device=b.device)  # every slot is written
            _weight_grad(h, g2d, rows, grad_b, (grad_b.stride(0), grad_b.stride(2), grad_b.stride(1)), plan)
        return grad_out, grad_h, grad_b, None, None


def _delta_then_gemm(x2d, weight_t, h, rows, lora_w, strides, plan: RoutingPlan) -> torch.Tensor:
    """``x2d @ weight_t`` plus the LoRA rows ``h @ W_s``: the expand writes the LoRA term into a fresh
    output (a write, no read), and the base GEMM adds its product to it in its epilogue (cuBLAS'
    ``beta = 1``). Adding the expand into the GEMM's output instead reads and writes the whole
    output once more."""
    shape = (x2d.shape[0], weight_t.shape[1])
    full = plan.num_routed == x2d.shape[0]  # rows left unrouted (base-model rows) add nothing
    out = torch.empty(shape, dtype=x2d.dtype, device=x2d.device) if full else x2d.new_zeros(shape)
    _expand(out, h, rows, lora_w, strides, plan, accumulate=False)
    return out.addmm_(x2d, weight_t)


class _LinearWithLoRA(torch.autograd.Function):
    """``x @ W^T`` of a frozen ``W`` plus every routed row's LoRA term, as one op: the expand writes
    the LoRA term and the base GEMM adds into it (:func:`_delta_then_gemm`), forward and for ``dx``
    (no second ``dx`` and no sum)."""

    @staticmethod
    def forward(ctx, x, weight, a, b, scale, plan: RoutingPlan, rows, fp8):  # type: ignore[override]
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        h = _shrink(x2d, rows, a, (a.stride(0), a.stride(1), a.stride(2)), a.shape[1], plan, scale)
        b_strides = (b.stride(0), b.stride(1), b.stride(2))
        if fp8 is None:
            out = _delta_then_gemm(x2d, weight.t(), h, rows, b, b_strides, plan)
        else:
            out = fp8_base.linear(x2d, fp8)
            _expand(out, h, rows, b, b_strides, plan, accumulate=True)
        ctx.save_for_backward(x2d, weight, a, b, scale, rows, h)
        ctx.plan, ctx.x_shape, ctx.fp8 = plan, x.shape, fp8
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2d, weight, a, b, scale, rows, h = ctx.saved_tensors
        plan: RoutingPlan = ctx.plan
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        if g2d.stride(-1) != 1:
            g2d = g2d.contiguous()
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[3]:
            grad_b = torch.empty(b.shape, dtype=b.dtype, device=b.device)  # every slot is written
            _weight_grad(h, g2d, rows, grad_b, (grad_b.stride(0), grad_b.stride(2), grad_b.stride(1)), plan)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            # scale_s * (dy @ B_s): the shrink scales its fp32 sums before it rounds (no extra passes)
            b_t = (b.stride(0), b.stride(2), b.stride(1))
            grad_z = _shrink(g2d, rows, b, b_t, b.shape[2], plan, scale)
            if ctx.needs_input_grad[0]:
                a_t = (a.stride(0), a.stride(2), a.stride(1))
                if ctx.fp8 is None:
                    grad_x = _delta_then_gemm(g2d, weight, grad_z, rows, a, a_t, plan)
                else:
                    grad_x = fp8_base.input_grad(g2d, ctx.fp8)
                    _expand(grad_x, grad_z, rows, a, a_t, plan, accumulate=True)
                grad_x = grad_x.view(ctx.x_shape)
            if ctx.needs_input_grad[2]:
                grad_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)  # every slot is written
                _weight_grad(
                    grad_z, x2d, rows, grad_a, (grad_a.stride(0), grad_a.stride(1), grad_a.stride(2)), plan
                )
        return grad_x, None, grad_a, grad_b, None, None, None, None


def linear_with_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    plan: RoutingPlan,
    rows: torch.Tensor,
    fp8: fp8_base.Fp8Weight | None = None,
) -> torch.Tensor:
    """``x @ weight^T`` (a frozen weight ``[M, K]``, no bias) with ``h[i] @ b[s_i]^T`` added at
    ``rows[i]``, ``h`` as :func:`gather_shrink` makes it: :func:`gather_shrink` and
    :func:`scatter_expand_add_` around the base GEMM, as one op (one layer, one TP rank). With
    ``fp8`` (the weight's FP8 copies) both base GEMMs run on them."""
    return _LinearWithLoRA.apply(x, weight, a, b, scale, plan, rows, fp8)


def gather_shrink(
    x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, plan: RoutingPlan, rows: torch.Tensor
) -> torch.Tensor:
    """``h[i] = scale[s_i] * x[rows[i]] @ a[s_i]^T`` for the routed tokens in grouped order."""
    return _GatherShrink.apply(x, a, scale, plan, rows)


def scatter_expand_add_(
    out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, plan: RoutingPlan, rows: torch.Tensor
) -> torch.Tensor:
    """In place: ``out.view(-1, M)[rows[i]] += h[i] @ b[s_i]^T``; returns ``out``."""
    return _ScatterExpandAdd.apply(out, h, b, plan, rows)
