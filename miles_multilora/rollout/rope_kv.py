"""One kernel per layer and decode step for RoPE on q and k plus the KV-cache write.

The unfused path (Megatron's ``apply_rotary_pos_emb`` on q and k, then
:func:`~miles_multilora.rollout.paged_attention.write_decode_kv`) is about twenty small kernels
per layer; at decode batch sizes each costs more in launch latency than in work. Here program
``(row, kv group)`` reads the group's slice of Megatron's fused QKV output in place (no split
copies), rotates its query heads into a new ``q`` and stores its k (rotated) and v straight into the
row's page; a deferred LoRA term of the QKV linear is added as the values are loaded.
``cos``/``sin`` come from per-position tables computed once exactly as Megatron does
(``(cos(freqs) * mscale).to(dtype)``). Non-interleaved RoPE over the whole head only;
:func:`fused_rope_kv_supported` says when this applies. fp8 pages get k and v quantised as
:func:`~miles_multilora.rollout.kv_quant.quantize` does (k rounded to the model dtype first, as the
unfused path stores it), each head's scale stored beside them.
"""

from __future__ import annotations

import torch

from miles_multilora._triton import HAVE_TRITON, tl, triton
from miles_multilora.lora.row_delta import RowDelta
from miles_multilora.rollout.kv_quant import FP8_INV_MAX, FP8_MAX

if HAVE_TRITON:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _FP8_INV_MAX = tl.constexpr(FP8_INV_MAX)

    @triton.jit
    def _fp8_scale(lo, hi):
        """One head's scale from its values in two halves (fp32): ``amax * fp32(1 / 448)``, 1 for zeros."""
        amax = tl.maximum(tl.max(tl.abs(lo), 0), tl.max(tl.abs(hi), 0))
        return tl.where(amax > 0, amax * _FP8_INV_MAX, 1.0)

    @triton.jit
    def _fp8(x, scale, dtype: tl.constexpr):
        """``x / scale`` (correctly rounded), clamped to e4m3's range and rounded to the nearest e4m3
        value (ties to even) in fp32 arithmetic, so the cast itself is exact: Triton's interpreter
        rounds fp32 -> fp8 casts wrongly (no carry into the exponent, ties away from zero)."""
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)  # div_rn does not broadcast
        y = tl.where(y == y, y, 0.0)  # never an e4m3 NaN in a page (kv_quant.quantize)
        y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
        a = tl.abs(y)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3: 2^-6 normal
        ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): e4m3 has 3 mantissa bits
        m = a * ((130 - e) << 23).to(tl.float32, bitcast=True)  # a / ulp, exactly
        f = tl.floor(m)
        up = (m - f > 0.5) | ((m - f == 0.5) & ((f.to(tl.int32) & 1) == 1))
        r = (f + tl.where(up, 1.0, 0.0)) * ulp
        return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r).to(dtype)

    @triton.jit
    def _load_head(ptr, lora_ptr, offs, mask, routed, HAS_LORA: tl.constexpr):
        """Values of a head in fp32; with the row's deferred LoRA term added and rounded to the
        model dtype first (as the in-place expand would have stored it)."""
        x = tl.load(ptr + offs, mask=mask, other=0.0)
        if HAS_LORA:
            lora = tl.load(lora_ptr + offs, mask=mask & routed, other=0.0)
            x = (x.to(tl.float32) + lora).to(ptr.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, lora_ptr, slots_ptr, cos_ptr, sin_ptr, pos_ptr, table_ptr, kc_ptr, vc_ptr, qo_ptr,
        ks_ptr, vs_ptr,
        stride_b, stride_g, stride_lb, stride_tab, stride_tb, stride_cp, stride_cs, stride_ch, stride_ob,
        stride_sp, stride_ss, stride_vp, stride_vs, stride_vh, stride_vd,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HAS_LORA: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        half: tl.constexpr = D // 2
        pos = tl.load(pos_ptr + b).to(tl.int64)
        lo = tl.arange(0, half)
        hi = lo + half
        cos_lo = tl.load(cos_ptr + pos * stride_tab + lo).to(tl.float32)
        cos_hi = tl.load(cos_ptr + pos * stride_tab + hi).to(tl.float32)
        sin_lo = tl.load(sin_ptr + pos * stride_tab + lo).to(tl.float32)
        sin_hi = tl.load(sin_ptr + pos * stride_tab + hi).to(tl.float32)
        routed = tl.load(slots_ptr + b) >= 0  # unused without a LoRA term (slots_ptr is then positions)
        src = qkv_ptr + b * stride_b + g * stride_g  # the group's G query heads, then k, then v
        lsrc = lora_ptr + b * stride_lb + g * stride_g
        # the group's query heads, rotated into q [B, H, D]
        heads = tl.arange(0, BLOCK_G)
        hmask = heads[:, None] < G
        q_lo = _load_head(src, lsrc, heads[:, None] * D + lo[None, :], hmask, routed, HAS_LORA)
        q_hi = _load_head(src, lsrc, heads[:, None] * D + hi[None, :], hmask, routed, HAS_LORA)
        dst = qo_ptr + b * stride_ob + (g * G + heads[:, None]) * D
        tl.store(
            dst + lo[None, :],
            (q_lo * cos_lo[None, :] - q_hi * sin_lo[None, :]).to(qo_ptr.dtype.element_ty),
            mask=hmask,
        )
        tl.store(
            dst + hi[None, :],
            (q_hi * cos_hi[None, :] + q_lo * sin_hi[None, :]).to(qo_ptr.dtype.element_ty),
            mask=hmask,
        )
        # its kv head: k rotated and v copied into the row's page
        page = tl.load(table_ptr + b * stride_tb + pos // PAGE).to(tl.int64)
        slot = page * stride_cp + (pos % PAGE) * stride_cs + g * stride_ch
        v_slot = page * stride_vp + (pos % PAGE) * stride_vs + g * stride_vh  # e4m3 values: keys-contiguous
        full = lo < half
        k_lo = _load_head(src + G * D, lsrc + G * D, lo, full, routed, HAS_LORA)
        k_hi = _load_head(src + G * D, lsrc + G * D, hi, full, routed, HAS_LORA)
        offs_d = tl.arange(0, D)
        v = _load_head(src + (G + 1) * D, lsrc + (G + 1) * D, offs_d, offs_d < D, routed, HAS_LORA)
        if KV_FP8:  # k in the model dtype, then each head quantised with its own scale
            rk_lo = (k_lo * cos_lo - k_hi * sin_lo).to(qo_ptr.dtype.element_ty).to(tl.float32)
            rk_hi = (k_hi * cos_hi + k_lo * sin_hi).to(qo_ptr.dtype.element_ty).to(tl.float32)
            scale_slot = page * stride_sp + (pos % PAGE) * stride_ss + g
            k_scale = _fp8_scale(rk_lo, rk_hi)
            v_scale = _fp8_scale(v, v)
            tl.store(ks_ptr + scale_slot, k_scale)
            tl.store(vs_ptr + scale_slot, v_scale)
            tl.store(kc_ptr + slot + lo, _fp8(rk_lo, k_scale, kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + slot + hi, _fp8(rk_hi, k_scale, kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + v_slot + offs_d * stride_vd, _fp8(v, v_scale, vc_ptr.dtype.element_ty))
        else:
            tl.store(kc_ptr + slot + lo, (k_lo * cos_lo - k_hi * sin_lo).to(kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + slot + hi, (k_hi * cos_hi + k_lo * sin_hi).to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + v_slot + offs_d * stride_vd, v.to(vc_ptr.dtype.element_ty))


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
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lora: RowDelta | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotated queries ``[B, H, D]`` (a new tensor) from Megatron's fused QKV output ``qkv``
    ``[B, groups, G + 2, D]`` (per kv group: its G query heads, then k, then v); the group's k
    (rotated) and v stored at ``positions`` in the pages of ``block_table``. ``lora``: the QKV
    linear's deferred LoRA term (``[B, groups * (G + 2) * D]`` fp32), added first. ``cos``/``sin``:
    ``[max_len, D]`` tables in the model dtype. fp8 (e4m3) caches come with their ``k_scale``/``v_scale``
    ``[num_pages, page_size, H_kv]`` (and keys-contiguous values; any value layout is written as its
    strides say). No host sync (CUDA-graph safe)."""
    batch, groups, width, dim = qkv.shape
    per_group = width - 2
    assert qkv.stride(-1) == 1 and qkv.stride(-2) == dim and k_cache.stride(-1) == 1
    out = torch.empty(batch, groups * per_group, dim, dtype=qkv.dtype, device=qkv.device)
    if lora is not None:
        assert lora.delta.shape == (batch, groups * width * dim) and lora.delta.stride(-1) == 1
    fp8 = k_scale is not None
    if fp8:
        assert v_scale is not None and k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    _rope_kv_kernel[(batch, groups)](
        qkv, lora.delta if lora is not None else qkv, lora.row_slots if lora is not None else positions,
        cos, sin, positions, block_table, k_cache, v_cache, out,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        qkv.stride(0), qkv.stride(1), lora.delta.stride(0) if lora is not None else 0,
        cos.stride(0), block_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0, *v_cache.stride(),
        G=per_group, BLOCK_G=triton.next_power_of_2(per_group), D=dim, PAGE=k_cache.shape[1],
        HAS_LORA=lora is not None, KV_FP8=fp8, num_warps=2,
    )  # fmt: skip
    return out
