"""One kernel per layer and decode step for RoPE on q and k plus the KV-cache write.

The unfused path (Megatron's ``apply_rotary_pos_emb`` on q and k, then
:func:`~miles_multilora.rollout.paged_attention.write_decode_kv`) is about twenty small kernels
per layer; at decode batch sizes each costs more in launch latency than in work. Here program
``(row, head)`` rotates one query head (written to a new ``q``) or one kv head (k rotated and v
copied straight into the row's page). ``cos``/``sin`` come from per-position tables computed once
exactly as Megatron does (``(cos(freqs) * mscale).to(dtype)``). Non-interleaved RoPE over the whole
head only; :func:`fused_rope_kv_supported` says when this applies.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

HAVE_TRITON = triton is not None

if HAVE_TRITON:

    @triton.jit
    def _rope_kv_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, table_ptr, kc_ptr, vc_ptr, qo_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_tab, stride_tb,
        stride_cp, stride_cs, stride_ch, stride_ob, stride_oh,
        HEADS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        lo = tl.arange(0, HALF)
        hi = lo + HALF
        cos_lo = tl.load(cos_ptr + pos * stride_tab + lo).to(tl.float32)
        cos_hi = tl.load(cos_ptr + pos * stride_tab + hi).to(tl.float32)
        sin_lo = tl.load(sin_ptr + pos * stride_tab + lo).to(tl.float32)
        sin_hi = tl.load(sin_ptr + pos * stride_tab + hi).to(tl.float32)
        if h < HEADS:
            src = q_ptr + b * stride_qb + h * stride_qh
            dst = qo_ptr + b * stride_ob + h * stride_oh
        else:
            j = h - HEADS
            page = tl.load(table_ptr + b * stride_tb + pos // PAGE).to(tl.int64)
            dst = kc_ptr + page * stride_cp + (pos % PAGE) * stride_cs + j * stride_ch
            src = k_ptr + b * stride_kb + j * stride_kh
            v_src = v_ptr + b * stride_vb + j * stride_vh
            v_dst = vc_ptr + page * stride_cp + (pos % PAGE) * stride_cs + j * stride_ch
            tl.store(v_dst + lo, tl.load(v_src + lo))
            tl.store(v_dst + hi, tl.load(v_src + hi))
        x_lo = tl.load(src + lo).to(tl.float32)
        x_hi = tl.load(src + hi).to(tl.float32)
        y_lo = x_lo * cos_lo - x_hi * sin_lo
        y_hi = x_hi * cos_hi + x_lo * sin_hi
        tl.store(dst + lo, y_lo.to(dst.dtype.element_ty))
        tl.store(dst + hi, y_hi.to(dst.dtype.element_ty))


def fused_rope_kv_supported(device: torch.device, head_dim: int, rot_dim: int, interleaved: bool) -> bool:
    """The fused kernel applies: CUDA, Triton, RoPE over the whole head, not interleaved, D a power of 2."""
    return (
        HAVE_TRITON
        and device.type == "cuda"
        and not interleaved
        and rot_dim == head_dim
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotated ``q`` ``[B, H, D]`` (a new tensor); rotated ``k`` and ``v`` (``[B, H_kv, D]``) stored at
    ``positions`` in the pages of ``block_table``. ``cos``/``sin``: ``[max_len, D]`` tables in the
    model dtype. No host sync (CUDA-graph safe)."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k_cache.stride(-1) == 1
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    _rope_kv_kernel[(batch, heads + kv_heads)](
        q, k, v, cos, sin, positions, block_table, k_cache, v_cache, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), block_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        HEADS=heads, HALF=dim // 2, PAGE=k_cache.shape[1], num_warps=1,
    )  # fmt: skip
    return out
