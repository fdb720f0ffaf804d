"""Triton kernels for routed LoRA: each reads token rows by index inside the GEMM (no gathered copy).

Tokens are grouped by slot through the routing plan's ``order`` (``rows[i]`` is the activation row of
the i-th grouped token); a *tile* is up to ``BLOCK_M`` consecutive grouped tokens of one slot. The
three kernels cover the LoRA forward and backward for any slot mix (per token or per sequence):

* :func:`gather_shrink`: ``y[i] = scale[s] * X[rows[i]] @ W[s]`` -> small ``[num_routed, R]``;
* :func:`scatter_expand`: ``OUT[rows[i]] (+)= h[i] @ W[s]`` -> writes activation rows in place;
* :func:`segment_weight_grad`: ``D[s] = sum_{i in slot s} P[i]^T X[rows[i]]`` for every slot, split
  over token chunks with a deterministic fp32 reduction when a slot spans several chunks.

Weights are passed as ``[N, a, b]`` tensors with explicit strides, so ``A``, ``B`` and their
transposes share one kernel each. The launchers take the schedules built by
:mod:`miles_multilora.lora.routed_ops`. Set ``TRITON_INTERPRET=1`` before import to run them on the CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from miles_multilora._triton import HAVE_TRITON, tl, triton
from miles_multilora.errors import ConfigError
from miles_multilora.lora.triton_launch import Launcher


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _pad_rank(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())  # plain ints: triton's helpers cost ~6 us a call


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(schedule: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A schedule's rows: a ``[k, n]`` tensor's, or the rows themselves (split once by the caller)."""
    return schedule if isinstance(schedule, tuple) else schedule.unbind(0)


if HAVE_TRITON:

    @triton.jit
    def tile_rows(tile, tile_slot_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, BLOCK_M: tl.constexpr):
        """A tile's slot, its grouped-token offsets and mask, and their activation rows."""
        slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        return slot, offs_m, mask_m, rows

    @triton.jit
    def tile_h(
        h_ptr, scale_ptr, slot, offs_m, mask_m, rows, R, stride_hp, stride_hm,
        NUM_PARTS: tl.constexpr, DENSE_H: tl.constexpr, BLOCK_R: tl.constexpr, OUT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """A tile's rows of the decode shrink, ready for the expand: the sum of the split-K partials
        (``[parts, T, R]`` by grouped row), or with ``DENSE_H`` the tile's slot's columns of the
        dense shrink (``[T, slots * R]`` by activation row) times its scale."""
        offs_r = tl.arange(0, BLOCK_R)
        h_mask = mask_m[:, None] & (offs_r < R)[None, :]
        if DENSE_H:
            h_ptrs = h_ptr + rows[:, None] * stride_hm + slot * stride_hp + offs_r[None, :]
            h = tl.load(h_ptrs, mask=h_mask, other=0.0).to(tl.float32) * tl.load(scale_ptr + slot)
        else:
            h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :]
            h = tl.load(h_ptrs, mask=h_mask, other=0.0)
            for part in tl.static_range(1, NUM_PARTS):
                h += tl.load(h_ptrs + part * stride_hp, mask=h_mask, other=0.0)
        return h.to(OUT_DTYPE)

    @triton.jit
    def _gather_shrink_kernel(
        x_ptr, rows_ptr, w_ptr, scale_ptr, y_ptr,
        tile_slot_ptr, tile_start_ptr, tile_end_ptr,
        K, R,
        stride_xm, stride_ws, stride_wr, stride_wk, stride_ym,
        HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        if tl.load(tile_end_ptr + tl.program_id(0)) <= tl.load(tile_start_ptr + tl.program_id(0)):
            return  # an empty tile of a fixed-length (device-built) schedule
        slot, offs_m, mask_m, rows = tile_rows(
            tl.program_id(0), tile_slot_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, BLOCK_M
        )
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        mask_r = offs_r < R
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + slot * stride_ws + offs_r[None, :] * stride_wr + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                wt = tl.load(w_ptrs, mask=mask_r[None, :], other=0.0)
            else:
                mask_k = offs_k < K - k
                xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + slot)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_r[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _split_shrink_kernel(
        x_ptr, rows_ptr, w_ptr, scale_ptr, y_ptr,
        tile_slot_ptr, tile_start_ptr, tile_end_ptr,
        K, R, K_CHUNK,
        stride_xm, stride_ws, stride_wr, stride_wk, stride_yp, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, part) reduces K_CHUNK of the K dim into its own fp32 partial: parallel over
        # K for the few rows of a decode step, deterministic (the expand kernel sums the parts).
        if tl.load(tile_end_ptr + tl.program_id(0)) <= tl.load(tile_start_ptr + tl.program_id(0)):
            return
        part = tl.program_id(1)
        slot, offs_m, mask_m, rows = tile_rows(
            tl.program_id(0), tile_slot_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, BLOCK_M
        )
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_start = part * K_CHUNK
        for k in range(k_start, k_start + K_CHUNK, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xt = tl.load(
                x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            wt = tl.load(
                w_ptr + slot * stride_ws + offs_r[None, :] * stride_wr + offs_k[:, None] * stride_wk,
                mask=mask_k[:, None] & mask_r[None, :],
                other=0.0,
            )
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        acc = acc * tl.load(scale_ptr + slot)
        y_ptrs = y_ptr + part * stride_yp + offs_m[:, None] * stride_ym + offs_r[None, :]
        tl.store(y_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])

    @triton.jit
    def _scatter_expand_kernel(
        h_ptr, rows_ptr, w_ptr, out_ptr, scale_ptr,
        tile_slot_ptr, tile_start_ptr, tile_end_ptr,
        N_OUT, R,
        stride_hp, stride_hm, stride_ws, stride_wn, stride_wr, stride_om,
        ACCUMULATE: tl.constexpr, SPLIT_N: tl.constexpr, NUM_PARTS: tl.constexpr, DENSE_H: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, j) covers output column blocks j, j + SPLIT_N, ...: h is loaded once and the
        # loop pipelines the next weight/output loads behind the current store.
        if tl.load(tile_end_ptr + tl.program_id(0)) <= tl.load(tile_start_ptr + tl.program_id(0)):
            return  # an empty tile of a fixed-length (device-built) schedule
        pid_n = tl.program_id(1)
        slot, offs_m, mask_m, rows = tile_rows(
            tl.program_id(0), tile_slot_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, BLOCK_M
        )
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        h = tile_h(
            h_ptr, scale_ptr, slot, offs_m, mask_m, rows, R, stride_hp, stride_hm,
            NUM_PARTS, DENSE_H, BLOCK_R, w_ptr.dtype.element_ty,
        )  # fmt: skip
        w_base = w_ptr + slot * stride_ws + offs_r[:, None] * stride_wr
        o_base = out_ptr + rows[:, None] * stride_om
        for n0 in range(pid_n * BLOCK_N, N_OUT, SPLIT_N * BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N_OUT
            w = tl.load(
                w_base + offs_n[None, :] * stride_wn, mask=mask_r[:, None] & mask_n[None, :], other=0.0
            )
            acc = tl.dot(h, w, input_precision=PRECISION)
            o_ptrs = o_base + offs_n[None, :]
            o_mask = mask_m[:, None] & mask_n[None, :]
            if ACCUMULATE:
                acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _segment_weight_grad_kernel(
        p_ptr, x_ptr, rows_ptr, out_ptr, ws_ptr,
        chunk_slot_ptr, chunk_start_ptr, chunk_end_ptr, chunk_dest_ptr,
        P, Q,
        stride_pm, stride_xm, stride_os, stride_op, stride_oq,
        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        chunk = tl.program_id(0)
        pid_q = tl.program_id(1)
        slot = tl.load(chunk_slot_ptr + chunk).to(tl.int64)
        start = tl.load(chunk_start_ptr + chunk)
        end = tl.load(chunk_end_ptr + chunk)
        dest = tl.load(chunk_dest_ptr + chunk).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mask_q = offs_q < Q
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for t in range(start, end, BLOCK_T):
            offs_t = t + tl.arange(0, BLOCK_T)
            mask_t = offs_t < end
            rows = tl.load(rows_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
            pt = tl.load(
                p_ptr + offs_t[None, :] * stride_pm + offs_p[:, None],
                mask=mask_p[:, None] & mask_t[None, :],
                other=0.0,
            )
            xt = tl.load(
                x_ptr + rows[:, None] * stride_xm + offs_q[None, :],
                mask=mask_t[:, None] & mask_q[None, :],
                other=0.0,
            )
            acc = tl.dot(pt, xt, acc, input_precision=PRECISION)
        mask = mask_p[:, None] & mask_q[None, :]
        if dest < 0:  # the slot's only chunk: write its gradient directly
            o_ptrs = out_ptr + slot * stride_os + offs_p[:, None] * stride_op + offs_q[None, :] * stride_oq
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:  # one of several chunks: an fp32 partial, summed in order by _reduce_partials_kernel
            w_ptrs = ws_ptr + dest * P * Q + offs_p[:, None] * Q + offs_q[None, :]
            tl.store(w_ptrs, acc, mask=mask)

    @triton.jit
    def _reduce_partials_kernel(
        ws_ptr, out_ptr, red_slot_ptr, red_first_ptr, red_count_ptr,
        P, Q, stride_os, stride_op, stride_oq,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        item = tl.program_id(0)
        pid = tl.program_id(1)
        slot = tl.load(red_slot_ptr + item).to(tl.int64)
        first = tl.load(red_first_ptr + item).to(tl.int64)
        count = tl.load(red_count_ptr + item)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < P * Q
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, count):
            acc += tl.load(ws_ptr + (first + c) * P * Q + offs, mask=mask, other=0.0)
        p = offs // Q
        q = offs % Q
        tl.store(
            out_ptr + slot * stride_os + p * stride_op + q * stride_oq,
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    # launched through a Launcher (lora.triton_launch): less host work per launch
    _launch_gather_shrink = Launcher(_gather_shrink_kernel)
    _launch_split_shrink = Launcher(_split_shrink_kernel)
    _launch_scatter_expand = Launcher(_scatter_expand_kernel)
    _launch_segment_weight_grad = Launcher(_segment_weight_grad_kernel)
    _launch_reduce_partials = Launcher(_reduce_partials_kernel)

# Launch configurations (block shapes, warps, pipeline stages) of the memory-bound skinny GEMMs,
# per kernel and LoRA rank bucket, measured on an H100 by ``benchmarks/tune_lora_kernels.py``
# (which can write a JSON file of another GPU's best; point MILES_MULTILORA_LORA_TUNING at it).
# ``BLOCK_M``: grouped tokens per tile (the schedule is built for it); ``SPLIT_N``: programs per
# tile along the output columns; ``CHUNKS_PER_SLOT`` / ``MIN_CHUNK``: a weight-gradient program
# reduces at most 1/CHUNKS_PER_SLOT of one slot's tokens but at least MIN_CHUNK of them.
SHRINK_CONFIGS = {
    16: dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=3),
    64: dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=3),
}
EXPAND_CONFIGS = {
    16: dict(BLOCK_M=32, BLOCK_N=128, SPLIT_N=8, num_warps=4, num_stages=1),
    64: dict(BLOCK_M=64, BLOCK_N=128, SPLIT_N=4, num_warps=4, num_stages=1),
}
WGRAD_CONFIGS = {
    16: dict(BLOCK_T=64, BLOCK_Q=128, MIN_CHUNK=1024, CHUNKS_PER_SLOT=16, num_warps=4, num_stages=2),
    64: dict(BLOCK_T=64, BLOCK_Q=128, MIN_CHUNK=1024, CHUNKS_PER_SLOT=16, num_warps=8, num_stages=2),
}
# Decode steps (one token per row, few rows per slot, schedule built on the device): small tiles,
# the K dim split over programs, every output block its own program (latency, not bandwidth, binds).
DECODE_SHRINK_CONFIG = dict(BLOCK_M=16, BLOCK_K=128, K_CHUNK=256, num_warps=4, num_stages=2)
DECODE_EXPAND_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_N=1 << 16, num_warps=4, num_stages=1)
REDUCE_BLOCK = 1024
TUNING_ENV = "MILES_MULTILORA_LORA_TUNING"
_TABLES = {"shrink": SHRINK_CONFIGS, "expand": EXPAND_CONFIGS, "wgrad": WGRAD_CONFIGS}


def load_tuning(path: str | os.PathLike) -> None:
    """Replace the launch configurations with a JSON file written by ``tune_lora_kernels.py --write``:
    ``{"shrink" | "expand" | "wgrad": {"<max rank>": {config}}}``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(TUNING_ENV, f"cannot read LoRA kernel tuning file {path}: {exc}") from exc
    if not isinstance(data, dict) or not set(data) <= set(_TABLES):
        raise ConfigError(TUNING_ENV, f"{path}: top-level keys must be among {sorted(_TABLES)}")
    for kernel, table in data.items():
        required = set(next(iter(_TABLES[kernel].values())))
        for bucket, cfg in table.items():
            if not str(bucket).isdigit() or not isinstance(cfg, dict) or set(cfg) != required:
                raise ConfigError(
                    TUNING_ENV,
                    f"{path}: {kernel}[{bucket!r}] must map a rank to a config with keys {sorted(required)}",
                )
    for kernel, table in data.items():
        _TABLES[kernel].clear()
        _TABLES[kernel].update({int(bucket): cfg for bucket, cfg in table.items()})


def launch_config(table: dict[int, dict], rank: int) -> dict:
    """The configuration of the smallest rank bucket that holds ``rank`` (the largest one past all)."""
    for bucket in sorted(table):
        if rank <= bucket:
            return table[bucket]
    return table[max(table)]


def _meta(cfg: dict) -> dict:
    """The kernel's compile-time block shapes (the schedule-only keys stay on the host)."""
    return {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}


def gather_shrink(
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    weight_strides: tuple[int, int, int],
    rank: int,
    tiles: torch.Tensor | tuple[torch.Tensor, ...],
    cfg: dict,
    num_routed: int,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[i, :rank] = scale[s] * x[rows[i]] @ W[s]`` with ``W[s][k, r]`` at ``s*ss + r*sr + k*sk``.

    ``x`` is ``[T, K]`` with unit column stride; ``tiles`` is the ``[3, n]`` (slot, start, end)
    schedule built for ``cfg["BLOCK_M"]``.
    """
    k_dim = x.shape[1]
    y = x.new_empty(num_routed, rank)
    tile_slot, tile_start, tile_end = _rows(tiles)
    if tile_slot.shape[0] == 0:
        return y
    _launch_gather_shrink(
        (tile_slot.shape[0],),
        x, rows, weight, scale if scale is not None else y, y,
        tile_slot, tile_start, tile_end,
        k_dim, rank,
        x.stride(0), weight_strides[0], weight_strides[1], weight_strides[2], y.stride(0),
        HAS_SCALE=scale is not None, EVEN_K=k_dim % cfg["BLOCK_K"] == 0,
        BLOCK_R=_pad_rank(rank), PRECISION=_precision(x.dtype), **_meta(cfg),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y


def split_shrink(
    x: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    weight_strides: tuple[int, int, int],
    rank: int,
    tiles: torch.Tensor | tuple[torch.Tensor, ...],
    cfg: dict,
    num_rows: int,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Decode shrink: fp32 partials ``y[p, i, :rank] = scale[s] * x[rows[i], chunk p] @ W[s][chunk p]``
    over ``cdiv(K, K_CHUNK)`` chunks of the K dim (``[parts, num_rows, rank]``; :func:`scatter_expand`
    sums them). Every tile of the fixed-length schedule may be empty (its programs return at once)."""
    k_dim = x.shape[1]
    parts = _cdiv(k_dim, cfg["K_CHUNK"])
    # every routed row of every part is written by its tile's program; other rows are never read
    y = torch.empty(parts, num_rows, rank, device=x.device, dtype=torch.float32)
    tile_slot, tile_start, tile_end = _rows(tiles)
    _launch_split_shrink(
        (tile_slot.shape[0], parts),
        x, rows, weight, scale, y,
        tile_slot, tile_start, tile_end,
        k_dim, rank, cfg["K_CHUNK"],
        x.stride(0), weight_strides[0], weight_strides[1], weight_strides[2], y.stride(0), y.stride(1),
        BLOCK_R=_pad_rank(rank), PRECISION=_precision(x.dtype), **_meta(cfg),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y


def expand_input(
    h: torch.Tensor, weight: torch.Tensor, dense: bool
) -> tuple[torch.Tensor, int, int, int, int]:
    """How an expand reads the shrink ``h`` (see :func:`scatter_expand`): ``(h, rank, stride between
    parts or slots, stride between rows, number of partial sums)``."""
    if dense:
        return h, h.shape[1] // weight.shape[0], h.shape[1] // weight.shape[0], h.stride(0), 1
    parts = h.unsqueeze(0) if h.dim() == 2 else h
    return parts, parts.shape[2], parts.stride(0), parts.stride(1), parts.shape[0]


def scatter_expand(
    out: torch.Tensor,
    h: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    weight_strides: tuple[int, int, int],
    tiles: torch.Tensor | tuple[torch.Tensor, ...],
    cfg: dict,
    accumulate: bool,
    dense_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows[i]] (+)= h[i] @ W[s]`` with ``W[s][r, n]`` at ``s*ss + n*sn + r*sr``; ``out`` ``[T, N_OUT]``.
    ``h`` is ``[T, R]``, or ``[parts, T, R]`` fp32 partial sums from :func:`split_shrink`, or with
    ``dense_scale`` (per-slot scales) ``[T, slots * R]``: every slot's unscaled shrink of every
    activation row (one dense GEMM), of which row ``rows[i]`` takes its slot's ``R`` columns."""
    tile_slot, tile_start, tile_end = _rows(tiles)
    if tile_slot.shape[0] == 0:
        return out
    parts, rank, stride_part, stride_row, num_parts = expand_input(h, weight, dense_scale is not None)
    n_out = out.shape[1]
    split_n = min(cfg["SPLIT_N"], _cdiv(n_out, cfg["BLOCK_N"]))
    grid = (tile_slot.shape[0], split_n)
    _launch_scatter_expand(
        grid,
        parts, rows, weight, out, dense_scale if dense_scale is not None else out,
        tile_slot, tile_start, tile_end,
        n_out, rank,
        stride_part, stride_row, weight_strides[0], weight_strides[1], weight_strides[2], out.stride(0),
        ACCUMULATE=accumulate, SPLIT_N=split_n, NUM_PARTS=num_parts,
        DENSE_H=dense_scale is not None, BLOCK_R=_pad_rank(rank), PRECISION=_precision(weight.dtype),
        **_meta(cfg),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def decode_expand(
    out: torch.Tensor,
    h: torch.Tensor,
    order: torch.Tensor,
    tiles: dict[int, torch.Tensor],
    weight: torch.Tensor,
    accumulate: bool,
    dense_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`scatter_expand` of a decode step: ``weight`` is ``lora_B`` ``[slots, out, R]``, the
    launch is ``DECODE_EXPAND_CONFIG`` and ``tiles`` the row routing's tile lists by ``BLOCK_M``."""
    cfg = DECODE_EXPAND_CONFIG
    return scatter_expand(
        out, h, order, weight, (weight.stride(0), weight.stride(1), weight.stride(2)),
        tiles[cfg["BLOCK_M"]], cfg, accumulate=accumulate, dense_scale=dense_scale,
    )  # fmt: skip


def segment_weight_grad(
    p: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    out_strides: tuple[int, int, int],
    chunks: torch.Tensor | tuple[torch.Tensor, ...],
    reductions: torch.Tensor | tuple[torch.Tensor, ...],
    num_partials: int,
    cfg: dict,
) -> torch.Tensor:
    """``D[s][p, q] = sum_{i in slot s} p[i, p] * x[rows[i], q]`` into ``out`` (``D[s][p, q]`` at
    ``s*so + p*sp + q*sq``). ``chunks`` is ``[4, n]`` (slot, start, end, partial index or -1) and
    ``reductions`` ``[3, m]`` (slot, first partial, count). A chunk with no tokens writes zeros.
    """
    p_dim, q_dim = p.shape[1], x.shape[1]
    chunk_slot, chunk_start, chunk_end, chunk_dest = _rows(chunks)
    if chunk_slot.shape[0] == 0:
        return out
    ws = torch.empty(max(num_partials, 1), p_dim, q_dim, device=p.device, dtype=torch.float32)
    grid = (chunk_slot.shape[0], _cdiv(q_dim, cfg["BLOCK_Q"]))
    _launch_segment_weight_grad(
        grid,
        p, x, rows, out, ws,
        chunk_slot, chunk_start, chunk_end, chunk_dest,
        p_dim, q_dim,
        p.stride(0), x.stride(0), out_strides[0], out_strides[1], out_strides[2],
        BLOCK_P=_pad_rank(p_dim), PRECISION=_precision(x.dtype), **_meta(cfg),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    red_slot, red_first, red_count = _rows(reductions)
    if red_slot.shape[0]:
        grid = (red_slot.shape[0], _cdiv(p_dim * q_dim, REDUCE_BLOCK))
        _launch_reduce_partials(
            grid,
            ws, out, red_slot, red_first, red_count,
            p_dim, q_dim, out_strides[0], out_strides[1], out_strides[2],
            BLOCK=REDUCE_BLOCK,
        )  # fmt: skip
    return out


if os.environ.get(TUNING_ENV):
    load_tuning(os.environ[TUNING_ENV])
