"""Paged decode attention (Triton split-K kernel and PyTorch path) equals a dense per-row attention,
and the cache writers put keys/values exactly where the block table says.

On a CPU machine the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest); on a GPU machine the ``cuda`` cases compile them, in fp32 and bf16, and capture them in
a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from miles_multilora.models.sdpa_attention import causal_attention
from miles_multilora.rollout import paged_attention as pa
from miles_multilora.rollout.paged_attention import (
    HAVE_TRITON,
    default_num_splits,
    key_block,
    paged_decode_attention,
    write_decode_kv,
    write_prefill_kv,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
KV_HEADS, DIM = 2, 16


def _lengths(page_size: int) -> list[int]:
    """Two pages and a bit, one token, exactly one page, empty, a page and a bit (shares row 0's first page)."""
    return [2 * page_size + 3, 1, page_size, 0, page_size + 5]


def _scenario(
    page_size: int, group: int, device: str, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Shuffled physical pages, row 4 sharing row 0's first page, every unused slot NaN in fp32."""
    gen = torch.Generator().manual_seed(seed)
    lengths = _lengths(page_size)
    max_pages = 3
    num_pages = 12
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lengths), max_pages, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for i in range((n + page_size - 1) // page_size):
            table[b, i] = table[0, 0] if (b, i) == (4, 0) else free.pop()
    shape = (num_pages, page_size, KV_HEADS, DIM)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for b, n in enumerate(lengths):
        for i in range(n):
            page, off = table[b, i // page_size], i % page_size
            k_cache[page, off] = torch.randn(KV_HEADS, DIM, generator=gen)
            v_cache[page, off] = torch.randn(KV_HEADS, DIM, generator=gen)
    if dtype != torch.float32:  # NaN only checks fp32; low precision gets finite garbage
        k_cache, v_cache = k_cache.nan_to_num(1e4), v_cache.nan_to_num(-1e4)
    q = torch.randn(len(lengths), KV_HEADS * group, DIM, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return tuple(
        t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        for t in (q, k_cache, v_cache, table, lens)
    )


def _dense(q, k_cache, v_cache, table, lens, scale) -> torch.Tensor:
    """Plain attention of each row over its own keys, gathered token by token, in fp64."""
    page_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pages = [table[b, i // page_size].item() for i in range(n)]
        keys = torch.stack([k_cache[p, i % page_size] for i, p in enumerate(pages)]).double().cpu()
        values = torch.stack([v_cache[p, i % page_size] for i, p in enumerate(pages)]).double().cpu()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [n, H, D]
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double().cpu(), keys) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, values)
    return out


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_torch_path_equals_dense(page_size, group):
    q, k_cache, v_cache, table, lens = _scenario(page_size, group, "cpu")
    got = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.3, use_triton=False)
    want = _dense(q, k_cache, v_cache, table, lens, 0.3)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(got[3]) == 0


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits,min_keys", [(1, 16), (3, 16), (3, 32)])
def test_triton_equals_dense(device, page_size, group, num_splits, min_keys, monkeypatch):
    """3 splits of 16+ keys: the longest row is cut 16 + 16 + 3 (page 16) and the shorter rows use
    the splits their length needs; with 32+ keys per split rows use 1 or 2 of the 3."""
    monkeypatch.setattr(pa, "BLOCK_N", 16)
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", min_keys)
    q, k_cache, v_cache, table, lens = _scenario(page_size, group, device)
    got = paged_decode_attention(
        q, k_cache, v_cache, table, lens, 0.3, num_splits=num_splits, use_triton=True
    )
    want = _dense(q, k_cache, v_cache, table, lens, 0.3)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[3]) == 0


def test_default_num_splits():
    assert default_num_splits(256, 8, 512) == 1  # enough programs already, rows of one chunk
    assert default_num_splits(256, 8, 4096) == 4  # the longest row in chunks of 1024 keys
    assert default_num_splits(512, 4, 32768) == 16  # capped
    assert default_num_splits(1, 8, 4096) == 16  # capped
    assert default_num_splits(8, 8, 1024) == 7  # ~3 programs per SM on 132 SMs
    assert default_num_splits(1, 1, 100) == 2  # no more splits than 64-key blocks
    assert default_num_splits(1, 1, 100, block=key_block(fp8=True)) == 1  # e4m3 pages: 128-key blocks
    assert default_num_splits(1, 8, 4096, block=key_block(fp8=True)) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])
def test_triton_bf16_and_defaults_cuda(group):
    q, k_cache, v_cache, table, lens = _scenario(16, group, "cuda", torch.bfloat16)
    want = _dense(q, k_cache, v_cache, table, lens, 0.25)
    for use_triton in (None, False):  # None: Triton on CUDA with the default number of splits
        got = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, use_triton=use_triton)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_large_cuda(dtype):
    """Realistic shapes: 128-dim heads, G=4, long rows over many shuffled 16-token pages."""
    gen = torch.Generator().manual_seed(3)
    batch, kv_heads, group, dim, page_size, max_pages = 6, 4, 4, 128, 16, 80
    perm = torch.randperm(batch * max_pages, generator=gen) + 1
    table = perm.view(batch, max_pages).to(torch.int32)
    lens = torch.tensor([1, 17, 300, 1024, 1280, 777], dtype=torch.int32)
    k_cache = torch.randn(batch * max_pages + 1, page_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    want = _dense(q, k_cache, v_cache, table, lens, dim**-0.5)
    args = [t.cuda() for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), table, lens)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_splits in (None, 1, 5, 16):
        got = paged_decode_attention(*args, dim**-0.5, num_splits=num_splits)
        torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cuda_graph_replay():
    q, k_cache, v_cache, table, lens = _scenario(16, 4, "cuda", torch.bfloat16)
    paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, num_splits=3)  # compile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, num_splits=3)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, num_splits=3)
    q2, _, _, table2, lens2 = _scenario(16, 4, "cuda", torch.bfloat16, seed=1)
    lens2 = lens2.flip(0).contiguous()  # other lengths per row, the empty row moves
    table2 = table2.flip(0).contiguous()
    for new_q, new_table, new_lens in ((q, table, lens), (q2, table2, lens2)):
        q.copy_(new_q)
        table.copy_(new_table)
        lens.copy_(new_lens)
        graph.replay()
        eager = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, num_splits=3)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        want = _dense(q, k_cache, v_cache, table, lens, 0.25)
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_decode_kv(device):
    page_size, gen = 8, torch.Generator().manual_seed(5)
    table = torch.tensor([[3, 7, 0], [5, 0, 0], [0, 0, 0], [2, 6, 4]], dtype=torch.int32)  # row 2 inactive
    positions = torch.tensor([9, 0, 0, 23])
    k_cache = torch.randn(8, page_size, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(8, page_size, KV_HEADS, DIM, generator=gen)
    k, v = torch.randn(4, KV_HEADS, DIM, generator=gen), torch.randn(4, KV_HEADS, DIM, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b, (page, off) in enumerate([(7, 1), (5, 0), (0, 0), (4, 7)]):
        want_k[page, off], want_v[page, off] = k[b], v[b]
    dev = [t.to(device) for t in (k_cache, v_cache, k, v, table, positions)]
    write_decode_kv(*dev)
    torch.testing.assert_close(dev[0].cpu(), want_k, rtol=0, atol=0)
    torch.testing.assert_close(dev[1].cpu(), want_v, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_prefill_kv(device):
    page_size, gen = 8, torch.Generator().manual_seed(6)
    table = torch.tensor([[4, 1, 6], [2, 0, 0], [0, 0, 0], [7, 3, 0]], dtype=torch.int32)
    lengths = torch.tensor([19, 8, 0, 9])
    k_cache = torch.randn(8, page_size, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(8, page_size, KV_HEADS, DIM, generator=gen)
    k = torch.randn(4, 20, KV_HEADS, DIM, generator=gen)
    v = torch.randn(4, 20, KV_HEADS, DIM, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        for i in range(n):
            page = table[b, i // page_size]
            want_k[page, i % page_size], want_v[page, i % page_size] = k[b, i], v[b, i]
    dev = [t.to(device) for t in (k_cache, v_cache, k, v, table, lengths)]
    write_prefill_kv(*dev)
    torch.testing.assert_close(dev[0].cpu(), want_k, rtol=0, atol=0)
    torch.testing.assert_close(dev[1].cpu(), want_v, rtol=0, atol=0)
    # Decode continues each row where its prompt ended; attention then sees prompt + new token.
    pos = lengths.to(device)
    new_k, new_v = torch.randn(4, KV_HEADS, DIM, device=device), torch.randn(4, KV_HEADS, DIM, device=device)
    write_decode_kv(dev[0], dev[1], new_k, new_v, dev[4], pos)
    assert torch.equal(dev[0][6, 3], new_k[0]) and torch.equal(dev[1][3, 1], new_v[3])


def test_bf16_torch_path_rounds_as_the_trainers_attention():
    """In bf16 the softmax weights meet the values rounded to bf16 (their sum is not), as in the
    Triton kernel and the trainer's fused attention: a decode step's output then rounds to the same
    bf16 value as the trainer's causal attention of the whole sequence nearly everywhere."""
    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, length, dim, page = 4, 6, 2, 96, 64, 16
    q = (torch.randn(rows, heads, length, dim, generator=gen) * 2).bfloat16()
    k = (torch.randn(rows, kv_heads, length, dim, generator=gen) * 2).bfloat16()
    v = torch.randn(rows, kv_heads, length, dim, generator=gen).bfloat16()
    trainer = causal_attention(q, k, v, dim**-0.5)  # [rows, heads, length, dim]
    pages = length // page
    table = torch.arange(1, 1 + rows * pages, dtype=torch.int32).view(rows, pages)
    k_cache = torch.zeros(1 + rows * pages, page, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_cache[1:] = k.transpose(1, 2).reshape(rows * pages, page, kv_heads, dim)
    v_cache[1:] = v.transpose(1, 2).reshape(rows * pages, page, kv_heads, dim)
    for n in (1, 9, 40, length):
        lens = torch.full((rows,), n, dtype=torch.int32)
        got = paged_decode_attention(
            q[:, :, n - 1], k_cache, v_cache, table, lens, dim**-0.5, use_triton=False
        )
        same = (got == trainer[:, :, n - 1]).float().mean()
        assert same > 0.95, (n, same)  # 0.98-1.0; 0.77-0.90 with unrounded weights
