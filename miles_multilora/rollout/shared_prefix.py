"""Shared-prefix ("cascade") decode attention: a group's shared prompt pages read once per step.

The samples of a prompt hold the same physical pages for its full prompt pages (reference-counted,
:mod:`~miles_multilora.rollout.kv_cache`). With ``rollout.shared_prefix_attention`` a decode step
splits each row's keys in two: the **prefix**, the leading whole pages the row shares with the rows
of its group, and the **suffix**, its own keys after them (the partial last prompt page and its
outputs). The prefix is attended once per (group, kv head) with every query head of every row of
the group stacked into one ``[rows * G, D] x [D, prefix]`` tile, so its K/V are read once for the
group instead of once per row; the suffix is today's split kernel started at the row's prefix
length. Both leave per-split partial outputs and log-sum-exps, and one merge weighs them: the same
softmax, only summed in another order (exact up to floating-point reassociation).

The grouping is device tensors of fixed shape (:class:`PrefixGroups`), written by the host between
runs of decode steps (:func:`plan_prefix_groups`), so a captured CUDA graph replays any grouping:

- ``prefix_lens[b]``: keys of row ``b``'s shared prefix (whole pages; 0: the row shares none);
- ``members[g]``: the rows of group ``g`` (at most ``MAX_GROUP_ROWS``; -1 pads), the first one's
  block table naming the prefix pages;
- ``group_lens[g]``: the group's prefix keys (0: no group ``g``).

A larger group is cut into several groups of one prefix (each reads it once). A preempted row
comes back with pages of its own, so it shares nothing until its group's rows are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles_multilora._triton import HAVE_TRITON, num_sms, tl, triton
from miles_multilora.rollout.kv_quant import FP8, as_bytes, dequantize
from miles_multilora.rollout.paged_attention import (
    LOG2E,
    NUM_STAGES,
    NUM_WARPS,
    default_num_splits,
    dot_dtype,
    key_block,
    launch_split_kernel,
    min_chunk_keys,
)

MAX_GROUP_ROWS = 8  # rows whose queries one prefix program stacks (a group of 8 samples: one program)


@dataclass
class PrefixGroups:
    """The grouping a decode step reads (see the module docstring); ``rows(n)``: its first ``n`` rows."""

    prefix_lens: Tensor  # [R] int32
    members: Tensor  # [R, MAX_GROUP_ROWS] int32
    group_lens: Tensor  # [R] int32

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> PrefixGroups:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            torch.zeros(rows, **i32), torch.full((rows, MAX_GROUP_ROWS), -1, **i32), torch.zeros(rows, **i32)
        )

    def rows(self, n: int) -> PrefixGroups:
        """The grouping of rows ``[0, n)`` (groups are at most as many as rows, and name rows < n)."""
        return PrefixGroups(self.prefix_lens[:n], self.members[:n], self.group_lens[:n])

    def tensors(self) -> list[Tensor]:
        return [self.prefix_lens, self.members, self.group_lens]

    def set(self, prefix_lens: list[int], groups: list[list[int]], group_lens: list[int]) -> None:
        """Write a plan (:func:`plan_prefix_groups`) in place; every other row and group is emptied."""
        rows = self.prefix_lens.shape[0]
        if len(prefix_lens) > rows or len(groups) > rows:
            raise ValueError(f"a plan of {len(prefix_lens)} rows and {len(groups)} groups, {rows} rows here")
        members = [g + [-1] * (MAX_GROUP_ROWS - len(g)) for g in groups]
        members += [[-1] * MAX_GROUP_ROWS] * (rows - len(groups))
        packed = torch.tensor(
            [
                *(prefix_lens + [0] * (rows - len(prefix_lens))),
                *(group_lens + [0] * (rows - len(groups))),
                *(m for row in members for m in row),
            ],
            dtype=torch.int32,
        ).to(self.prefix_lens.device)
        self.prefix_lens.copy_(packed[:rows])
        self.group_lens.copy_(packed[rows : 2 * rows])
        self.members.copy_(packed[2 * rows :].view(rows, MAX_GROUP_ROWS))


def plan_prefix_groups(
    row_pages: list[list[int]], row_keys: list[int], page_size: int
) -> tuple[list[int], list[list[int]], list[int]]:
    """Group rows by the whole leading pages they share: ``row_pages[b]`` are row b's pages in order,
    ``row_keys[b]`` the keys it has written (its next step attends over more). Rows starting on the
    same page form a group whose prefix is the longest run of pages they all hold, cut to the pages
    every one of them has filled; groups are cut into ``MAX_GROUP_ROWS`` rows. Returns
    ``(prefix_lens, groups, group_lens)`` (a row of no group: prefix 0)."""
    by_first: dict[int, list[int]] = {}
    for b, pages in enumerate(row_pages):
        if pages:
            by_first.setdefault(pages[0], []).append(b)
    prefix_lens = [0] * len(row_pages)
    groups: list[list[int]] = []
    group_lens: list[int] = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        shared = min(min(len(row_pages[b]) for b in rows), min(row_keys[b] for b in rows) // page_size)
        first = row_pages[rows[0]]
        common = next((i for i in range(shared) if any(row_pages[b][i] != first[i] for b in rows)), shared)
        if common == 0:
            continue
        for start in range(0, len(rows), MAX_GROUP_ROWS):
            groups.append(rows[start : start + MAX_GROUP_ROWS])
            group_lens.append(common * page_size)
        for b in rows:
            prefix_lens[b] = common * page_size
    return prefix_lens, groups, group_lens


# ---------------------------------------------------------------------------------------------- torch
def _gather(cache: Tensor, scale: Tensor | None, pages: Tensor) -> Tensor:
    """Keys or values of block-table rows ``pages`` ``[N, P]`` -> ``[N, P * page_size, H_kv, D]`` fp32."""
    n, p = pages.shape
    out = as_bytes(cache)[pages].view(cache.dtype).reshape(n, p * cache.shape[1], *cache.shape[2:])
    if scale is not None:
        out = dequantize(out, scale[pages].reshape(n, p * cache.shape[1], cache.shape[2]))
    return out.float()


def _partial(scores: Tensor, values: Tensor, valid: Tensor, spec: str) -> tuple[Tensor, Tensor]:
    """Softmax over the last axis of ``scores`` restricted to ``valid``: (normalized output, natural
    log-sum-exp; -inf and zeros where nothing is valid). ``spec``: the einsum of probs and values."""
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum(spec, probs, values), lse


def _torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: Tensor,
    lens: Tensor,
    scale: float,
    groups: PrefixGroups,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> Tensor:
    """Both parts in fp32 PyTorch (each row's whole table gathered: for exactness, not speed)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    g = heads // kv_heads
    qf = q.float().view(batch, kv_heads, g, dim)
    pages = table.long()
    keys, values = _gather(k_cache, k_scale, pages), _gather(v_cache, v_scale, pages)
    pos = torch.arange(keys.shape[1], device=q.device)
    start = groups.prefix_lens.long().unsqueeze(1)
    own = (pos >= start) & (pos < lens.long().unsqueeze(1))  # [B, L]: the suffix
    values = values.masked_fill(~own[:, :, None, None], 0.0)  # stale slots may hold inf/NaN
    scores = torch.einsum("bkgd,blkd->bkgl", qf, keys) * scale
    o_suf, lse_suf = _partial(scores, values, own[:, None, None, :], "bkgl,blkd->bkgd")
    # the prefix: once per group, the queries of all its rows together
    members = groups.members.long()
    used = members >= 0
    leader = members[:, 0].clamp(min=0)
    glen = groups.group_lens.long()
    p_keys, p_values = _gather(k_cache, k_scale, pages[leader]), _gather(v_cache, v_scale, pages[leader])
    in_prefix = pos[: p_keys.shape[1]] < glen.unsqueeze(1)  # [NG, L]
    p_values = p_values.masked_fill(~in_prefix[:, :, None, None], 0.0)
    gq = qf[members.clamp(min=0)]  # [NG, R, H_kv, G, D]
    p_scores = torch.einsum("nrkgd,nlkd->nrkgl", gq, p_keys) * scale
    o_pre, lse_pre = _partial(p_scores, p_values, in_prefix[:, None, None, None, :], "nrkgl,nlkd->nrkgd")
    row_o = torch.zeros_like(o_suf)
    row_lse = torch.full_like(lse_suf, float("-inf"))
    row_o[members[used]] = o_pre[used]
    row_lse[members[used]] = lse_pre[used]
    # merge: each part weighed by its share of the row's softmax denominator
    m = torch.maximum(row_lse, lse_suf)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_pre, w_suf = torch.exp(row_lse - m), torch.exp(lse_suf - m)
    total = w_pre + w_suf
    out = (w_pre.unsqueeze(-1) * row_o + w_suf.unsqueeze(-1) * o_suf) / torch.where(
        total > 0, total, torch.ones_like(total)
    ).unsqueeze(-1)
    return out.reshape(batch, heads, dim).to(q.dtype)


# --------------------------------------------------------------------------------------------- triton
if HAVE_TRITON:
    from miles_multilora.rollout.paged_attention import attend_key_range, split_chunk

    @triton.jit
    def _prefix_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, members_ptr, glens_ptr, part_o_ptr, part_lse_ptr,
        qk_scale, G, D, H, total_splits,
        stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_sp, stride_st, stride_bt, stride_mg,
        FIRST_SLOT: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
        MIN_CHUNK: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
        FP8_AS_FP16: tl.constexpr,
    ):  # fmt: skip
        """Program (group, kv head, split): online softmax of the G query heads of every row of the
        group (``BLOCK_M = rows * BLOCK_G`` query lines) over the split's prefix keys, read once.
        Stores each row's partial output and log2-sum-exp at split slot ``FIRST_SLOT + split``
        (nothing for a split past the prefix, or a group without one)."""
        grp = tl.program_id(0)
        hk = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(glens_ptr + grp)
        chunk = split_chunk(length, NUM_SPLITS, BLOCK_N, MIN_CHUNK)
        start = split * chunk
        end = tl.minimum(start + chunk, length)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        r = offs_m // BLOCK_G
        gh = offs_m % BLOCK_G
        row = tl.load(members_ptr + grp * stride_mg + r, mask=r < GROUP_ROWS, other=-1)
        mask_m = (row >= 0) & (gh < G)
        mask_d = offs_d < D
        heads = hk * G + gh
        q = tl.load(
            q_ptr + row.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        if KV_FP8:
            if FP8_AS_FP16:  # e4m3 keys and values widen to fp16 in one instruction (dot_dtype)
                q = q.to(tl.float16)
        else:
            q = q.to(k_ptr.dtype.element_ty)
        leader = tl.maximum(tl.load(members_ptr + grp * stride_mg), 0)
        bt_row = bt_ptr + leader.to(tl.int64) * stride_bt
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        acc, m_i, l_i = attend_key_range(
            q, acc, m_i, l_i, start, end, bt_row, k_ptr, v_ptr, ks_ptr, vs_ptr, hk, qk_scale, offs_d, mask_d,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_sp, stride_st,
            PAGE_SIZE, BLOCK_N, PRECISION, KV_FP8,
        )  # fmt: skip

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = (row.to(tl.int64) * H + heads) * total_splits + FIRST_SLOT + split  # [B, H, total]
        store = mask_m & (start < length)
        tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], o, mask=store[:, None] & mask_d[None, :])
        tl.store(part_lse_ptr + part, lse, mask=store)

    @triton.jit
    def _merge_kernel(
        part_o_ptr, part_lse_ptr, lens_ptr, prefix_ptr, out_ptr,
        H, D, max_len, stride_ob, stride_oh,
        SUFFIX_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Program (row, head): log-sum-exp merge of the row's used suffix splits (slots
        ``[0, SUFFIX_SPLITS)``) and prefix splits (the next ``PREFIX_SPLITS``); zeros for no keys."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        length = tl.minimum(tl.load(lens_ptr + b), max_len)
        prefix = tl.minimum(tl.load(prefix_ptr + b), length)
        own = length - prefix
        used_s = tl.cdiv(own, split_chunk(own, SUFFIX_SPLITS, BLOCK_N, MIN_CHUNK))
        used_p = tl.cdiv(prefix, split_chunk(prefix, PREFIX_SPLITS, BLOCK_N, MIN_CHUNK))
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = (offs_s < used_s) | ((offs_s >= SUFFIX_SPLITS) & (offs_s < SUFFIX_SPLITS + used_p))
        mask_d = offs_d < D
        part = (b * H + h) * (SUFFIX_SPLITS + PREFIX_SPLITS) + offs_s
        lse = tl.load(part_lse_ptr + part, mask=mask_s, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
        o = tl.load(part_o_ptr + part[:, None] * D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :])
        o = tl.where(mask_s[:, None] & mask_d[None, :], o, 0.0)
        total = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=mask_d
        )


def _triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: Tensor,
    lens: Tensor,
    scale: float,
    groups: PrefixGroups,
    num_splits: int | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> Tensor:
    """The suffix split kernel, the prefix kernel and the merge, into one partial buffer."""
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert heads % kv_heads == 0 and groups.members.shape[1] == MAX_GROUP_ROWS
    fp8 = k_scale is not None
    group = heads // kv_heads
    max_len = table.shape[1] * page_size
    sms = num_sms(q.device)
    block = key_block(fp8)
    suffix = num_splits or default_num_splits(batch, kv_heads, max_len, sms, block)
    prefix = num_splits or default_num_splits(max(1, batch // MAX_GROUP_ROWS), kv_heads, max_len, sms, block)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    total = suffix + prefix
    part_o = torch.empty(batch, heads, total, dim, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(batch, heads, total, device=q.device, dtype=torch.float32)
    launch_split_kernel(
        q, k_cache, v_cache, table, lens, scale, suffix, k_scale, v_scale, out, part_o, part_lse,
        starts=groups.prefix_lens, total_splits=total,
    )  # fmt: skip
    block_g = triton.next_power_of_2(group)
    block_m = max(16, triton.next_power_of_2(MAX_GROUP_ROWS * block_g))
    block_d = max(16, triton.next_power_of_2(dim))
    compute = dot_dtype(q.dtype, k_cache.dtype, fp8)
    _prefix_kernel[(groups.members.shape[0], kv_heads, prefix)](
        q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, table,
        groups.members, groups.group_lens, part_o, part_lse,
        scale * LOG2E, group, dim, heads, total,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *((k_scale.stride(0), k_scale.stride(1)) if fp8 else (0, 0)), table.stride(0),
        groups.members.stride(0),
        FIRST_SLOT=suffix, NUM_SPLITS=prefix, PAGE_SIZE=page_size, MIN_CHUNK=min_chunk_keys(block),
        GROUP_ROWS=MAX_GROUP_ROWS, BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block,
        PRECISION="ieee" if compute == torch.float32 else "tf32", KV_FP8=fp8, FP8_AS_FP16=fp8 and compute == torch.float16,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    _merge_kernel[(batch, heads)](
        part_o, part_lse, lens, groups.prefix_lens, out, heads, dim, max_len, out.stride(0), out.stride(1),
        SUFFIX_SPLITS=suffix, PREFIX_SPLITS=prefix, MIN_CHUNK=min_chunk_keys(block), BLOCK_N=block,
        BLOCK_S=triton.next_power_of_2(total), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def shared_prefix_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    scale: float,
    groups: PrefixGroups,
    num_splits: int | None = None,
    use_triton: bool | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """What :func:`~miles_multilora.rollout.paged_attention.paged_decode_attention` returns (same
    arguments), each group's shared prefix read once for all its rows (``groups``: its first
    ``B`` rows, :meth:`PrefixGroups.rows`). ``num_splits``: splits of both passes (None: chosen
    by size). No host sync, shapes from the arguments only: capturable in a CUDA graph."""
    if (k_scale is None) != (v_scale is None) or (k_scale is not None) != (k_cache.dtype == FP8):
        raise ValueError("fp8 K/V pages need both k_scale and v_scale (and only fp8 pages take them)")
    if groups.prefix_lens.shape[0] != q.shape[0] or groups.members.shape[0] != q.shape[0]:
        raise ValueError(f"a grouping of {groups.prefix_lens.shape[0]} rows for {q.shape[0]} queries")
    if use_triton is None:
        use_triton = HAVE_TRITON and q.is_cuda
    if use_triton:
        return _triton(
            q, k_cache, v_cache, block_table, cache_lens, scale, groups, num_splits, k_scale, v_scale
        )
    return _torch(q, k_cache, v_cache, block_table, cache_lens, scale, groups, k_scale, v_scale)
