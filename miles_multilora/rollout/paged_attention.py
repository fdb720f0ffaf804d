"""Decode attention over a paged KV cache: writers for the cache and one-token-per-row attention.

Each layer keeps ``k_cache``/``v_cache`` of shape ``[num_pages, page_size, H_kv, D]``. Row ``b``'s
token ``i`` lives in page ``block_table[b, i // page_size]`` at offset ``i % page_size``; the row's
first ``cache_lens[b]`` tokens are valid. Page 0 is the null page that unused table entries point at.
Query head ``h`` reads kv head ``h // G`` (``G = H // H_kv``, Megatron's GQA layout). An fp8 cache
(:mod:`~miles_multilora.rollout.kv_quant`) passes its ``k_scale``/``v_scale`` ``[num_pages, page_size,
H_kv]`` too: the writers quantise, and attention reads ``value * scale`` (on CUDA: the e4m3 values
widened to the query's dtype, the key scales applied to the scores and the value scales to the
probabilities, in fp32).

:func:`paged_decode_attention` runs a split-K ("flash decoding") Triton kernel on CUDA and a PyTorch
gather + masked softmax elsewhere. The decode path (:func:`write_decode_kv` and the attention) never
syncs with the host and allocates by shape only, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from miles_multilora._triton import HAVE_TRITON, num_sms, tl, triton
from miles_multilora.config.sections.rollout import FP8_MAX_PAGE_SIZE
from miles_multilora.rollout.kv_quant import FP8, as_bytes, dequantize, is_keys_contiguous, quantize

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
PROGRAMS_PER_SM = 3
# Fewest keys a split takes (rounded down to whole key blocks): a row of n keys uses
# ceil(n / chunk) of the splits, so short rows stay whole while the longest row is cut into
# MAX_SPLITS programs, and no step waits for one program walking a long row alone.
MIN_SPLIT_KEYS = 1024
# Keys per loop iteration, warps and pipeline stages of the split kernel: on an H100 (bf16, D=128,
# page_size 16) this streams the cache at ~2.95 TB/s for large batches (32 or 128 keys: 1-3% slower).
BLOCK_N = 64
# e4m3 pages take twice the keys per iteration: on an H200 (D=128, page_size 16) their kernel ran
# 11-14% faster at 128 keys than at 64 (the widening to fp16 costs per iteration; the bytes halve).
# Their values are read in whole pages, so it is a multiple of every page size the config allows.
FP8_BLOCK_N = FP8_MAX_PAGE_SIZE
NUM_WARPS = 4
NUM_STAGES = 2


if HAVE_TRITON:

    @triton.jit
    def split_chunk(length, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
        """Keys per split of a row of ``length`` keys: whole key blocks, at least ``MIN_CHUNK``."""
        return tl.maximum(tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)

    @triton.jit
    def attend_key_range(
        q, acc, m_i, l_i, start, end, bt_row, k_ptr, v_ptr, ks_ptr, vs_ptr, hk, qk_scale, offs_d, mask_d,
        stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_sp, stride_st,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    ):  # fmt: skip
        """Online softmax of the query lines ``q`` over the paged keys ``[start, end)`` of kv head ``hk``
        (block table row ``bt_row``), carried in ``(acc, m_i, l_i)`` (log2 units). ``KV_FP8``: e4m3
        pages widened to q's dtype, their per-(token, head) scales applied in fp32; the values
        keys-contiguous (``stride_vt`` 1, head dim stride ``PAGE_SIZE``) and ``start`` a page's first key."""
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            tok = offs_n % PAGE_SIZE
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                k_ptr + (page * stride_kp + tok * stride_kt + hk * stride_kh)[:, None] + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if KV_FP8:
                k = k.to(q.dtype)  # exact: every e4m3 value is a bf16/fp16/fp32 value
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if KV_FP8:
                scale_at = page * stride_sp + tok * stride_st + hk  # the keys' scales, then the values'
                s = s * tl.load(ks_ptr + scale_at, mask=mask_n, other=0.0)[None, :]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_FP8:  # keys-contiguous e4m3 values: a [pages, D, PAGE_SIZE] tile, 16-byte runs of keys
                NUM_PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
                first = n0 + tl.arange(0, NUM_PAGES) * PAGE_SIZE  # each page's first key (n0: a page start)
                offs_t = tl.arange(0, PAGE_SIZE)
                v_page = tl.load(bt_row + first // PAGE_SIZE, mask=first < end, other=0).to(tl.int64)
                v = tl.load(
                    v_ptr
                    + (v_page * stride_vp + hk * stride_vh)[:, None, None]
                    + offs_d[None, :, None] * PAGE_SIZE
                    + offs_t[None, None, :],
                    mask=(first < end)[:, None, None] & mask_d[None, :, None],  # whole pages: 16-byte loads
                    other=0.0,
                )  # a last page's slots past the row: finite (kv_quant.quantize), weighed by p = 0
                v = tl.reshape(tl.permute(v, (0, 2, 1)), (BLOCK_N, v.shape[1])).to(q.dtype)
                p = p * tl.load(vs_ptr + scale_at, mask=mask_n, other=0.0)[None, :]
            else:
                v = tl.load(
                    v_ptr + (page * stride_vp + tok * stride_vt + hk * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_mask,
                    other=0.0,
                )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, starts_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, G, D, max_len, part_stride,
        stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_sp, stride_st, stride_bt, stride_ob, stride_oh,
        NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, MIN_CHUNK: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr, HAS_START: tl.constexpr, FP8_AS_FP16: tl.constexpr,
    ):  # fmt: skip
        """Program (row, kv head, split): online softmax of the G query heads over the split's keys.
        A split past the row's keys stores nothing (the combine reads only the row's used splits).
        ``HAS_START``: the row's keys begin at ``starts_ptr[b]`` (its suffix past a shared prefix,
        :mod:`~miles_multilora.rollout.shared_prefix`), and every used split stores a partial result
        (``part_stride`` slots per (row, head)).
        ``KV_FP8``: e4m3 pages, widened to q's dtype; ``ks_ptr``/``vs_ptr`` their per-(token, head)
        scales (strides ``stride_sp``, ``stride_st``; heads contiguous), applied in fp32."""
        b = tl.program_id(0)
        hk = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.minimum(tl.load(lens_ptr + b), max_len)
        first = 0
        if HAS_START:
            first = tl.minimum(tl.load(starts_ptr + b), length)
        chunk = split_chunk(length - first, NUM_SPLITS, BLOCK_N, MIN_CHUNK)
        start = first + split * chunk
        end = tl.minimum(start + chunk, length)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < G
        mask_d = offs_d < D
        heads = hk * G + offs_g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        )
        if KV_FP8:
            if FP8_AS_FP16:  # e4m3 keys and values widen to fp16 in one instruction (dot_dtype)
                q = q.to(tl.float16)
        else:
            q = q.to(k_ptr.dtype.element_ty)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        acc, m_i, l_i = attend_key_range(
            q, acc, m_i, l_i, start, end, bt_row, k_ptr, v_ptr, ks_ptr, vs_ptr, hk, qk_scale, offs_d, mask_d,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_sp, stride_st,
            PAGE_SIZE, BLOCK_N, PRECISION, KV_FP8,
        )  # fmt: skip

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or row) gives zeros
        mask_o = mask_g[:, None] & mask_d[None, :]
        if NUM_SPLITS == 1 and not HAS_START:
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_o)
        elif start < length:
            part = (b * G * tl.num_programs(1) + heads) * part_stride + split  # [B, H, part_stride]
            tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], o, mask=mask_o)
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=mask_g)

    @triton.jit
    def _combine_splits_kernel(
        part_o_ptr, part_lse_ptr, lens_ptr, out_ptr,
        H, D, max_len, stride_ob, stride_oh,
        NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Program (row, head): log-sum-exp merge of the normalized outputs of the row's used splits
        (none for an empty row: zeros)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.minimum(tl.load(lens_ptr + b), max_len)
        used = tl.cdiv(length, split_chunk(length, NUM_SPLITS, BLOCK_N, MIN_CHUNK))
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < used
        mask_d = offs_d < D
        part = (b * H + h) * NUM_SPLITS + offs_s
        lse = tl.load(part_lse_ptr + part, mask=mask_s, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
        o_mask = mask_s[:, None] & mask_d[None, :]
        o = tl.load(part_o_ptr + part[:, None] * D + offs_d[None, :], mask=o_mask, other=0.0)
        total = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=mask_d
        )


def _store(cache: torch.Tensor, scales: torch.Tensor | None, flat: torch.Tensor, x: torch.Tensor) -> None:
    """``x`` ``[N, H_kv, D]`` into token slots ``flat`` of ``cache`` (quantised when ``scales``; e4m3
    value pages are keys-contiguous, :func:`~miles_multilora.rollout.kv_quant.keys_contiguous`)."""
    if scales is not None:
        x, s = quantize(x)
        scales.view(-1, scales.shape[-1]).index_copy_(0, flat, s)
    target, values = as_bytes(cache), as_bytes(x.to(cache.dtype))
    if cache.is_contiguous():
        target.view(-1, *cache.shape[2:]).index_copy_(0, flat, values)
    else:
        page_size = cache.shape[1]
        target[flat // page_size, flat % page_size] = values


def write_decode_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store one token per row: ``k[b], v[b]`` (``[B, H_kv, D]``) at token ``positions[b]`` of row b
    (fp8 pages: quantised, their scales in ``k_scale``/``v_scale``).

    No host sync, shape-only indexing (CUDA-graph safe). Rows may all point at the null page.
    """
    page_size = k_cache.shape[1]
    pos = positions.long()
    page = block_table.gather(1, (pos // page_size).unsqueeze(1)).squeeze(1).long()
    flat = page * page_size + pos % page_size
    _store(k_cache, k_scale, flat, k)
    _store(v_cache, v_scale, flat, v)


def write_prefill_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store right-padded prompts: ``k, v`` ``[B, S, H_kv, D]``, positions ``0 .. lengths[b]-1`` only
    (fp8 pages: quantised, their scales in ``k_scale``/``v_scale``)."""
    page_size = k_cache.shape[1]
    valid = torch.arange(k.shape[1], device=k.device) < lengths.to(k.device).unsqueeze(1)
    rows, pos = valid.nonzero(as_tuple=True)
    flat = block_table[rows, pos // page_size].long() * page_size + pos % page_size
    _store(k_cache, k_scale, flat, k[rows, pos])
    _store(v_cache, v_scale, flat, v[rows, pos])


def default_num_splits(
    batch: int, num_kv_heads: int, max_len: int, num_sms: int = 132, block: int | None = None
) -> int:
    """Splits per (row, kv head): enough for ~PROGRAMS_PER_SM programs per SM, and enough that the
    longest possible row is cut into chunks of MIN_SPLIT_KEYS (rows use only the splits their
    length needs); at most MAX_SPLITS, and no more than the key blocks (of ``block`` keys) of that row."""
    block = block or BLOCK_N
    programs = max(batch * num_kv_heads, 1)
    want = max(-(-PROGRAMS_PER_SM * num_sms // programs), -(-max_len // min_chunk_keys(block)))
    return max(1, min(want, MAX_SPLITS, -(-max_len // block)))


def key_block(fp8: bool) -> int:
    """Keys per loop iteration of the attention kernels: FP8_BLOCK_N for e4m3 pages, else BLOCK_N."""
    return FP8_BLOCK_N if fp8 else BLOCK_N


def min_chunk_keys(block: int | None = None) -> int:
    """MIN_SPLIT_KEYS in whole key blocks of ``block`` keys (default BLOCK_N; at least one)."""
    block = block or BLOCK_N
    return max(block, MIN_SPLIT_KEYS // block * block)


def check_value_pages(v_cache: torch.Tensor, fp8: bool, block: int) -> None:
    """The attention kernels' layout of value pages: head-dim-contiguous, or keys-contiguous e4m3 pages
    (:func:`~miles_multilora.rollout.kv_quant.keys_contiguous`) whose page size divides the key block."""
    if not fp8:
        assert v_cache.stride(-1) == 1
        return
    if not is_keys_contiguous(v_cache):
        raise ValueError(
            "e4m3 value pages must be keys-contiguous (kv_quant.keys_contiguous(pages); PagedKVCache "
            f"allocates them so), got strides {tuple(v_cache.stride())} for shape {tuple(v_cache.shape)}"
        )
    page_size = v_cache.shape[1]
    if block % page_size:
        raise ValueError(
            f"fp8 pages of {page_size} tokens: the page size must divide {block} (a power of 2 <= it)"
        )


def dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, fp8: bool) -> torch.dtype:
    """The dtype of the attention kernels' dot products: the cache's; with e4m3 pages fp16 for a
    16-bit model (e4m3 -> fp16 is exact and one conversion instruction per pair on Hopper; to bf16 it
    goes through fp16 or fp32, and the e4m3 kernel was slower per value than the bf16 one,
    docs/benchmarks.md), fp32 for an fp32 one."""
    if not fp8:
        return cache_dtype
    return torch.float32 if q_dtype == torch.float32 else torch.float16


def launch_split_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    starts: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> None:
    """The split kernel over every row: one split straight into ``out``, else partial outputs and
    log2-sum-exps into ``part_o``/``part_lse`` (``[B, H, total_splits, D]``/``[B, H, total_splits]``,
    the row's splits first). ``starts``: the rows' first keys (then every split goes to the parts)."""
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert heads % kv_heads == 0, f"{heads} query heads are not a multiple of {kv_heads} kv heads"
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    fp8 = k_scale is not None
    if fp8:
        assert v_scale is not None and k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if fp8 else (0, 0)
    compute = dot_dtype(q.dtype, k_cache.dtype, fp8)
    block = key_block(fp8)
    check_value_pages(v_cache, fp8, block)
    group = heads // kv_heads
    max_len = block_table.shape[1] * page_size
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        block_table, cache_lens, starts if starts is not None else cache_lens, out, part_o, part_lse,
        scale * LOG2E, group, dim, max_len, total_splits or num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides, block_table.stride(0), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, PAGE_SIZE=page_size, MIN_CHUNK=min_chunk_keys(block),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block, PRECISION="ieee" if compute == torch.float32 else "tf32", KV_FP8=fp8,
        HAS_START=starts is not None, FP8_AS_FP16=fp8 and compute == torch.float16, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip


def _attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    max_len = block_table.shape[1] * page_size
    block = key_block(k_scale is not None)
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_len, num_sms(q.device), block)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits > 1:
        part_o = torch.empty(batch, heads, num_splits, dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(batch, heads, num_splits, device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused
    launch_split_kernel(
        q,
        k_cache,
        v_cache,
        block_table,
        cache_lens,
        scale,
        num_splits,
        k_scale,
        v_scale,
        out,
        part_o,
        part_lse,
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch, heads)](
            part_o, part_lse, cache_lens, out, heads, dim, max_len, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk_keys(block), BLOCK_N=block,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        )  # fmt: skip
    return out


def _attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    max_len = block_table.shape[1] * page_size
    pages = block_table.long()
    # gathered as bytes: index kernels are not implemented for float8 everywhere
    keys = as_bytes(k_cache)[pages].view(k_cache.dtype).reshape(batch, max_len, kv_heads, dim)
    values = as_bytes(v_cache)[pages].view(v_cache.dtype).reshape(batch, max_len, kv_heads, dim)
    if k_scale is not None and v_scale is not None:  # fp8 pages: their values times their scales
        keys = dequantize(keys, k_scale[pages].reshape(batch, max_len, kv_heads))
        values = dequantize(values, v_scale[pages].reshape(batch, max_len, kv_heads))
    keys, values = keys.float(), values.float()
    qg = q.float().view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
    valid = torch.arange(max_len, device=q.device) < cache_lens.to(q.device).unsqueeze(1)  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    probs = torch.exp(scores - torch.where(top.isfinite(), top, 0.0))  # rows without keys: zeros
    total = probs.sum(-1, keepdim=True)
    if k_scale is None:
        # the weights rounded to the model dtype before they meet the values, as every fused attention
        # does (the Triton kernel here, flash and PyTorch's CPU kernel in the trainer); the sum is not
        probs = probs.to(q.dtype).float()
    values = values.masked_fill(~valid[:, :, None, None], 0.0)  # stale slots may hold inf/NaN
    out = torch.einsum("bkgl,blkd->bkgd", probs, values) / torch.where(total > 0, total, 1.0)
    return out.reshape(batch, heads, dim).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    use_triton: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b`` over row b's first ``cache_lens[b]`` keys.

    ``q`` ``[B, H, D]``; caches ``[num_pages, page_size, H_kv, D]``; ``block_table`` ``[B, max_pages]``
    int32; ``cache_lens`` ``[B]`` int32. fp32 accumulation, output in q's dtype, zeros for empty rows.
    On 16-bit pages the softmax weights meet the values rounded to q's dtype (their sum stays fp32),
    as the Triton kernel and the trainer's flash attention do, so a decode step's output rounds as the
    trainer's does.
    ``use_triton=None``: the Triton kernel for CUDA tensors, PyTorch otherwise (``True`` forces Triton,
    e.g. under ``TRITON_INTERPRET=1``). ``num_splits=None``: :func:`default_num_splits`. A narrower
    ``block_table`` view (fewer columns) bounds the work to that many pages per row. fp8 caches
    (e4m3) come with their ``k_scale``/``v_scale`` ``[num_pages, page_size, H_kv]`` (fp32).
    """
    if (k_scale is None) != (v_scale is None) or (k_scale is not None) != (k_cache.dtype == FP8):
        raise ValueError("fp8 K/V pages need both k_scale and v_scale (and only fp8 pages take them)")
    if use_triton is None:
        use_triton = HAVE_TRITON and q.is_cuda
    if use_triton:
        return _attention_triton(
            q, k_cache, v_cache, block_table, cache_lens, scale, num_splits, k_scale, v_scale
        )
    return _attention_torch(q, k_cache, v_cache, block_table, cache_lens, scale, k_scale, v_scale)
