"""Fused elementwise kernels of a decode step: residual add + RMSNorm, and SwiGLU.

At decode batch sizes a layer is launch-bound: Megatron's modules run the residual add, the
norm and the gated activation (a strided chunk, SiLU and a product) as separate kernels, each one
a full pass over the activations. Here ``add_rmsnorm`` writes the new residual (rounded to the
model dtype, as the unfused add is) and its normalised copy in one pass, and ``swiglu`` computes
``silu(a) * b`` of the two halves of ``linear_fc1``'s output in one. :func:`fusable` says which
modules they may stand in for (torch RMSNorm, SiLU-gated MLP without clamping, offsets or bias);
anything else runs the module itself. Both take the deferred LoRA term of the linear whose output
they read (:class:`~miles_multilora.lora.row_delta.RowDelta`) and add it as they load. The SwiGLU
kernel is the model's own (:func:`miles_multilora.models.fused_mlp.swiglu`, which training uses too);
here it gains the variant that runs ``linear_fc1``'s LoRA expand.
"""

from __future__ import annotations

import torch

from miles_multilora._triton import HAVE_TRITON, num_sms, tl, triton
from miles_multilora.lora import triton_kernels as tk
from miles_multilora.lora.row_delta import RowDelta, RowShrink
from miles_multilora.models import fused_mlp
from miles_multilora.models.fused_mlp import silu_gated_mlp

# the SwiGLU that runs fc1's LoRA expand: output columns per work item, programs per SM, warps
SWIGLU_EXPAND_CONFIG = dict(BLOCK_N=128, PROGRAMS_PER_SM=8, num_warps=4)

if HAVE_TRITON:
    from miles_multilora.lora.triton_kernels import tile_h, tile_rows

    @triton.jit
    def _add_rmsnorm_kernel(
        res_ptr, delta_ptr, weight_ptr, res_out_ptr, norm_out_ptr, lora_ptr, slots_ptr, H, stride_d, eps,
        HAS_DELTA: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
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
    def _swiglu_expand_kernel(
        x_ptr, out_ptr, h_ptr, w_ptr, scale_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
        num_tiles_ptr, F_DIM, R, NUM_SLOTS, stride_x, stride_hp, stride_hm, stride_ws, stride_wn, stride_wr,
        NUM_PARTS: tl.constexpr, DENSE_H: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The work items (non-empty tile of rows of one slot, column block), tile-major, are split
        evenly over the programs, whatever the slot mix. Per item: fc1's LoRA expand for the tile's
        rows (tiles of slot ``NUM_SLOTS``, the base-only rows, have none) added to both halves as the
        in-place expand rounds it, then ``silu(a) * b``. A program reads a tile's shrink once."""
        n_blocks = tl.cdiv(F_DIM, BLOCK_N)
        total = tl.load(num_tiles_ptr) * n_blocks
        per = tl.cdiv(total, tl.num_programs(0))
        first = tl.program_id(0) * per
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=w_ptr.dtype.element_ty)
        h_tile = -1
        for item in range(first, tl.minimum(first + per, total)):
            tile = item // n_blocks
            slot, offs_m, mask_m, rows = tile_rows(
                tile, tile_slot_ptr, tile_start_ptr, tile_end_ptr, rows_ptr, BLOCK_M
            )
            offs_n = (item % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < F_DIM
            mask = mask_m[:, None] & mask_n[None, :]
            a_ptrs = x_ptr + rows[:, None] * stride_x + offs_n[None, :]
            a = tl.load(a_ptrs, mask=mask, other=0.0)
            b = tl.load(a_ptrs + F_DIM, mask=mask, other=0.0)
            if slot < NUM_SLOTS:
                if tile != h_tile:
                    h = tile_h(
                        h_ptr, scale_ptr, slot, offs_m, mask_m, rows, R, stride_hp, stride_hm,
                        NUM_PARTS, DENSE_H, BLOCK_R, w_ptr.dtype.element_ty,
                    )  # fmt: skip
                    h_tile = tile
                w_ptrs = w_ptr + slot * stride_ws + offs_r[:, None] * stride_wr + offs_n[None, :] * stride_wn
                w_mask = mask_r[:, None] & mask_n[None, :]
                w_a = tl.load(w_ptrs, mask=w_mask, other=0.0)
                w_b = tl.load(w_ptrs + F_DIM * stride_wn, mask=w_mask, other=0.0)
                a = (tl.dot(h, w_a, input_precision=PRECISION) + a.to(tl.float32)).to(a.dtype)
                b = (tl.dot(h, w_b, input_precision=PRECISION) + b.to(tl.float32)).to(b.dtype)
            af = a.to(tl.float32)
            y = af / (1.0 + tl.exp(-af)) * b.to(tl.float32)
            tl.store(
                out_ptr + rows[:, None] * F_DIM + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
            )


def fusable(norm: torch.nn.Module, mlp: torch.nn.Module, device: torch.device) -> tuple[bool, bool]:
    """``(norm, mlp)``: whether ``add_rmsnorm`` / ``swiglu`` may replace these modules on ``device``."""
    if not (HAVE_TRITON and device.type == "cuda"):
        return False, False
    norm_ok = (
        type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps is not None
    )  # exact type: subclasses may change the math
    return norm_ok, silu_gated_mlp(mlp)


def add_rmsnorm(
    residual: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.RMSNorm, lora: RowDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, rmsnorm(residual + delta))``, the sum rounded to the model dtype first
    (``delta`` None: just the norm). ``lora``: ``delta``'s deferred LoRA term, added to it first.
    Shapes ``[..., H]``; one pass, one kernel."""
    if lora is not None and delta is None:
        raise ValueError("a LoRA term needs the output it belongs to (delta)")
    hidden = residual.shape[-1]
    x = residual.reshape(-1, hidden).contiguous()
    rows = x.shape[0]
    res_out = torch.empty_like(x) if delta is not None else x
    norm_out = torch.empty_like(x)
    d = delta.reshape(-1, hidden) if delta is not None else x  # rows may be strided (a stacked GEMM's)
    if d.stride(-1) != 1:
        d = d.contiguous()
    _add_rmsnorm_kernel[(rows,)](
        x, d, norm.weight, res_out, norm_out,
        lora.delta if lora is not None else x, lora.row_slots if lora is not None else x,
        hidden, d.stride(0), float(norm.eps), HAS_DELTA=delta is not None, HAS_LORA=lora is not None,
        BLOCK=triton.next_power_of_2(hidden), num_warps=4 if hidden <= 4096 else 8,
    )  # fmt: skip
    return res_out.view(residual.shape), norm_out.view(residual.shape)


def swiglu(x: torch.Tensor, lora: RowDelta | RowShrink | None = None) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` for ``x`` ``[..., 2F]`` (Megatron's gated linear unit);
    ``lora``: ``x``'s deferred LoRA term, added to it first (a :class:`RowShrink`: its expand runs
    here, per tile of rows of one slot)."""
    if not isinstance(lora, RowShrink):  # the model's kernel, with the LoRA term added as it loads
        return fused_mlp.swiglu(x, *((lora.delta, lora.row_slots) if lora is not None else ()))
    two_f = x.shape[-1]
    rows = x.reshape(-1, two_f)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    f_dim = two_f // 2
    out = torch.empty(rows.shape[0], f_dim, dtype=x.dtype, device=x.device)
    _swiglu_expand(rows, out, lora)
    return out.view(*x.shape[:-1], f_dim)


def _swiglu_expand(x: torch.Tensor, out: torch.Tensor, lora: RowShrink) -> None:
    block_m = tk.DECODE_EXPAND_CONFIG["BLOCK_M"]
    tiles, w = lora.plan.all_tiles[block_m], lora.weight
    h, rank, stride_part, stride_row, num_parts = tk.expand_input(lora.h, w, lora.dense_scale is not None)
    f_dim = out.shape[1]
    cfg = SWIGLU_EXPAND_CONFIG
    items = tiles.shape[1] * triton.cdiv(f_dim, cfg["BLOCK_N"])  # at most
    programs = min(items, cfg["PROGRAMS_PER_SM"] * num_sms(x.device))
    _swiglu_expand_kernel[(programs,)](
        x, out, h, w, lora.dense_scale if lora.dense_scale is not None else out, lora.plan.order,
        tiles[0], tiles[1], tiles[2], lora.plan.all_tile_counts[block_m],
        f_dim, rank, lora.plan.num_slots, x.stride(0), stride_part, stride_row,
        w.stride(0), w.stride(1), w.stride(2),
        NUM_PARTS=num_parts, DENSE_H=lora.dense_scale is not None, BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_R=max(16, triton.next_power_of_2(rank)),
        PRECISION="ieee" if w.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"],
    )  # fmt: skip
