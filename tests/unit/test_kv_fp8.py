"""FP8 KV pages (``rollout.kv_cache_dtype=fp8``): e4m3 values with a scale per token and kv head.

Attention over fp8 pages equals attention over the values they give back (exactly on the PyTorch
path, fp32; within fp32 rounding in the Triton kernel) and stays within a stated tolerance of the
unquantised cache; the writers (prefill, decode, the fused RoPE kernel) store each token's own
quantisation; the page budget counts a byte per value plus the scales. On a CPU machine the Triton
kernels run under the interpreter; the ``cuda`` cases (bf16, CUDA graphs) need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from miles_multilora.config.run import config_from_container
from miles_multilora.lora.row_delta import RowDelta
from miles_multilora.rollout import paged_attention as pa
from miles_multilora.rollout.kv_cache import PagedKVCache, kv_bytes_per_token
from miles_multilora.rollout.kv_quant import (
    FP8,
    FP8_MAX,
    as_stored,
    dequantize,
    is_keys_contiguous,
    keys_contiguous,
    quantize,
)
from miles_multilora.rollout.paged_attention import (
    HAVE_TRITON,
    paged_decode_attention,
    write_decode_kv,
    write_prefill_kv,
)
from miles_multilora.rollout.rope_kv import rope_and_write_kv
from miles_multilora.trainer import memory_plan as mp
from miles_multilora.trainer.memory_plan import GIB, ModelShape
from tests.unit.test_paged_attention import DEVICES, DIM, KV_HEADS, _dense, _scenario

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
# Attention output vs the unquantised cache, N(0, 1) keys and values: e4m3 keeps 3 mantissa bits (a
# value moves by at most 1/16 of itself; a one-key row returns its value so rounded). Measured over
# five seeds of the scenario: worst element 0.04-0.09, mean 0.009-0.012.
FP8_ATTENTION_MAX_ERROR = 0.15
FP8_ATTENTION_MEAN_ERROR = 0.02


def _fp8_pages(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """The scenario's pages quantised (stale slots: finite garbage), and fp32 pages holding exactly
    what the fp8 pages give back."""
    kq, ks = quantize(k_cache.nan_to_num(1e4))
    vq, vs = quantize(v_cache.nan_to_num(-1e4))
    vq = keys_contiguous(vq)  # e4m3 value pages as the cache lays them out
    return (kq, vq, ks, vs), (dequantize(kq, ks), dequantize(vq, vs))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_quantize_never_stores_an_e4m3_nan():
    """The kernels read a last page's slots past the row in whole runs and weigh them by 0: a stale
    NaN byte would turn that 0 into NaN, so a NaN input stores 0."""
    x = torch.tensor([[1.0, float("nan"), -2.0], [float("inf"), 1.0, 0.5], [3.0, 4.0, 5.0]])
    values, scales = quantize(x)
    assert not values.float().isnan().any()
    assert torch.equal(dequantize(values[0], scales[0]), torch.tensor([1.0, 0.0, -2.0]))
    assert torch.equal(dequantize(values[2:], scales[2:]), dequantize(*quantize(x[2:])))


def test_quantize_keeps_each_heads_values_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 3e4]).view(1, 3, 1)
    x[2, 1] = 0.0  # an all-zero head
    x[3, 0, 7] = 1e30  # one huge value: its head's scale follows it, nothing overflows
    values, scales = quantize(x)
    assert values.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (5, 3)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scales, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
    back = dequantize(values, scales)
    assert back.isfinite().all() and back[2, 1].eq(0).all() and values.float().abs().max() == FP8_MAX
    # relative error <= 2^-4 for normals; e4m3's subnormals (below 2^-6 of the scale) lose more
    tol = x.abs() / 16 + scales.unsqueeze(-1) * 2.0**-9
    assert ((back - x).abs() <= tol).all()
    assert torch.equal(as_stored(x.bfloat16()), dequantize(*quantize(x.bfloat16()), dtype=torch.bfloat16))


@pytest.mark.parametrize("group", [1, 4])
def test_fp8_pages_attend_exactly_as_the_values_they_give_back(group):
    q, k_cache, v_cache, table, lens = _scenario(8, group, "cpu")
    (kq, vq, ks, vs), (kd, vd) = _fp8_pages(k_cache, v_cache)
    got = paged_decode_attention(q, kq, vq, table, lens, 0.3, use_triton=False, k_scale=ks, v_scale=vs)
    assert torch.equal(got, paged_decode_attention(q, kd, vd, table, lens, 0.3, use_triton=False))
    exact = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.3, use_triton=False)
    error = (got - exact).abs()[lens > 0]  # quantised, and close to the fp32 cache
    assert 0 < error.max() < FP8_ATTENTION_MAX_ERROR and error.mean() < FP8_ATTENTION_MEAN_ERROR
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        paged_decode_attention(q, kq, vq, table, lens, 0.3, use_triton=False, k_scale=ks)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_reads_fp8_pages_and_their_scales(device, group, num_splits, monkeypatch):
    monkeypatch.setattr(pa, "BLOCK_N", 16)
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", 16)
    q, k_cache, v_cache, table, lens = _scenario(8, group, "cpu")
    (kq, vq, ks, vs), (kd, vd) = _fp8_pages(k_cache, v_cache)
    args = [t.to(device) for t in (q, kq, vq, table, lens)]
    got = paged_decode_attention(
        *args, 0.3, num_splits=num_splits, use_triton=True, k_scale=ks.to(device), v_scale=vs.to(device)
    )
    want = _dense(q, kd, vd, table, lens, 0.3)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[3]) == 0


@pytest.mark.gpu
def test_triton_fp8_bf16_large_and_in_a_cuda_graph():
    """Realistic shapes in bf16 (128-dim heads, G=4, long rows over shuffled pages) against the
    dequantised reference, then a captured replay equal to the eager call."""
    gen = torch.Generator().manual_seed(3)
    batch, kv_heads, group, dim, page_size, max_pages = 6, 4, 4, 128, 16, 80
    table = (torch.randperm(batch * max_pages, generator=gen) + 1).view(batch, max_pages).to(torch.int32)
    lens = torch.tensor([1, 17, 300, 1024, 1280, 777], dtype=torch.int32)
    k_cache = torch.randn(batch * max_pages + 1, page_size, kv_heads, dim, generator=gen)
    (kq, vq, ks, vs), (kd, vd) = _fp8_pages(k_cache, torch.randn(k_cache.shape, generator=gen))
    q = torch.randn(batch, kv_heads * group, dim, generator=gen).bfloat16()
    want = _dense(q, kd, vd, table, lens, dim**-0.5)
    q, kq, vq, ks, vs, table, lens = (t.cuda() for t in (q, kq, vq, ks, vs, table, lens))
    scales = dict(k_scale=ks, v_scale=vs)
    for num_splits in (None, 1, 5, 16):
        got = paged_decode_attention(q, kq, vq, table, lens, dim**-0.5, num_splits=num_splits, **scales)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode_attention(q, kq, vq, table, lens, dim**-0.5, **scales)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, kq, vq, table, lens, dim**-0.5, **scales)
    lens.copy_(lens.flip(0))
    graph.replay()
    eager = paged_decode_attention(q, kq, vq, table, lens, dim**-0.5, **scales)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_writers_store_each_tokens_own_quantisation(device):
    page_size, gen = 8, torch.Generator().manual_seed(5)
    shape = (8, page_size, KV_HEADS, DIM)

    def empty() -> list[torch.Tensor]:  # the values keys-contiguous, as the cache keeps them
        values = [torch.zeros(shape, dtype=FP8, device=device) for _ in range(2)]
        values[1] = keys_contiguous(values[1])
        return values + [torch.zeros(shape[:-1], device=device) for _ in range(2)]

    def check(pages: list[torch.Tensor], slots: list[tuple[int, int]], k, v) -> None:  # noqa: ANN001
        want = [torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)]
        want += [torch.zeros(shape[:-1]), torch.zeros(shape[:-1])]
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
        for i, (page, off) in enumerate(slots):
            for t, x in zip(want, (kq[i], vq[i], ks[i], vs[i]), strict=True):
                _bytes(t)[page, off] = _bytes(x)
        for got, w in zip(pages, want, strict=True):
            assert torch.equal(_bytes(got).cpu(), _bytes(w))

    table = torch.tensor([[3, 7, 0], [5, 0, 0], [0, 0, 0], [2, 6, 4]], dtype=torch.int32)  # row 2 inactive
    positions = torch.tensor([9, 0, 0, 23])
    k, v = torch.randn(4, KV_HEADS, DIM, generator=gen), 50 * torch.randn(4, KV_HEADS, DIM, generator=gen)
    pages = empty()
    kc, vc, ks, vs = pages
    write_decode_kv(kc, vc, k.to(device), v.to(device), table.to(device), positions.to(device), ks, vs)
    check(pages, [(7, 1), (5, 0), (0, 0), (4, 7)], k, v)

    table = torch.tensor([[4, 1, 6], [2, 0, 0], [0, 0, 0], [7, 3, 0]], dtype=torch.int32)
    lengths = torch.tensor([19, 8, 0, 9])
    k, v = torch.randn(4, 20, KV_HEADS, DIM, generator=gen), torch.randn(4, 20, KV_HEADS, DIM, generator=gen)
    pages = empty()
    kc, vc, ks, vs = pages
    write_prefill_kv(kc, vc, k.to(device), v.to(device), table.to(device), lengths.to(device), ks, vs)
    rows = [(b, i) for b, n in enumerate(lengths.tolist()) for i in range(n)]
    slots = [(int(table[b, i // page_size]), i % page_size) for b, i in rows]
    check(pages, slots, torch.stack([k[b, i] for b, i in rows]), torch.stack([v[b, i] for b, i in rows]))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_lora", [False, True])
def test_fused_rope_kernel_writes_what_quantising_the_unfused_write_gives(device, with_lora):
    """The fused RoPE + KV write into fp8 pages stores exactly ``quantize`` of what it stores into
    fp32 pages (fp32 model: the same k and v), scales included."""
    gen = torch.Generator().manual_seed(0)
    batch, groups, per_group, dim, page, pages = 5, 2, 3, 16, 8, 30
    qkv = (torch.randn(batch, groups, per_group + 2, dim, generator=gen) * 4).to(device)
    lora = None
    if with_lora:
        delta = torch.randn(batch, groups * (per_group + 2) * dim, generator=gen).to(device)
        lora = RowDelta(delta, torch.tensor([0, -1, 2, 1, -1], device=device))
    freqs = torch.outer(torch.arange(40).float(), 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
    freqs = torch.cat([freqs, freqs], dim=-1).to(device)
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    positions = torch.tensor([0, 7, 8, 15, 33], device=device)
    table = torch.randperm(pages - 1, generator=gen)[:25].add(1).view(batch, 5).int().to(device)
    kc, vc = (torch.zeros(pages, page, groups, dim, device=device) for _ in range(2))
    want_q = rope_and_write_kv(qkv, cos, sin, positions, table, kc, vc, lora)
    cache = PagedKVCache(1, pages, page, groups, dim, torch.float32, torch.device(device), fp8=True)
    k_pages, v_pages, k_scale, v_scale = cache.layer(0)
    got_q = rope_and_write_kv(qkv, cos, sin, positions, table, k_pages, v_pages, lora, k_scale, v_scale)
    assert torch.equal(got_q, want_q)
    for values, scales, ref in ((cache.k[0], cache.k_scale[0], kc), (cache.v[0], cache.v_scale[0], vc)):
        want_values, want_scales = quantize(ref)
        written = torch.zeros(pages, page, dtype=torch.bool, device=device)
        written[table.long().gather(1, (positions // page).unsqueeze(1)).squeeze(1), positions % page] = True
        want_scales[~written] = 0  # slots nothing was written to keep the cache's zeros
        assert torch.equal(scales, want_scales)
        # values, not bytes: the interpreter's casts drop the sign of -0.0
        assert torch.equal(values[written].float(), want_values[written].float())


def test_fp8_value_pages_are_keys_contiguous_and_the_kernels_refuse_others():
    """The cache stores e4m3 values with each page's keys contiguous (the split kernel reads them as
    [pages, D, page_size] tiles); a head-dim-contiguous e4m3 value tensor is refused with the fix."""
    cache = PagedKVCache(2, 6, 8, 2, 16, torch.bfloat16, torch.device("cpu"), fp8=True)
    assert is_keys_contiguous(cache.v[1]) and not is_keys_contiguous(cache.k[1])
    assert cache.v.shape == cache.k.shape and cache.v.stride(2) == 1
    pages = torch.randn(6, 8, 2, 16)
    assert torch.equal(keys_contiguous(pages), pages) and is_keys_contiguous(keys_contiguous(pages))
    q, table, lens = torch.randn(1, 4, 16), torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([12])
    (kq, ks), (vq, vs) = quantize(pages), quantize(pages)
    with pytest.raises(ValueError, match="keys-contiguous"):
        pa.launch_split_kernel(
            q, kq, vq, table, lens, 0.25, 1, ks, vs, torch.empty_like(q), q, q
        )  # checked before any launch


def test_an_fp8_cache_copies_scales_with_pages_and_counts_them_in_its_bytes():
    cache = PagedKVCache(3, 6, 4, 2, 16, torch.bfloat16, torch.device("cpu"), fp8=True)
    for t in cache.tensors():
        _bytes(t).copy_(torch.randint(0, 100, t.shape).to(_bytes(t).dtype))
    cache.copy_pages([1, 2], [4, 5])
    for t in cache.tensors():
        assert torch.equal(_bytes(t)[:, 4:], _bytes(t)[:, 1:3])
    assert cache.nbytes == 6 * 4 * kv_bytes_per_token(3, 2, 16, 2, fp8=True)
    plain = PagedKVCache(3, 6, 4, 2, 16, torch.bfloat16, torch.device("cpu"))
    assert plain.k_scale is None and plain.nbytes == 6 * 4 * kv_bytes_per_token(3, 2, 16, 2, fp8=False)


def test_the_memory_plan_counts_fp8_pages_and_their_scales():
    for dim, ratio in ((64, 128 / 68), (128, 256 / 132)):  # SmolLM2-135M's heads, then 128-dim heads
        assert (
            kv_bytes_per_token(30, 3, dim, 2, fp8=False) / kv_bytes_per_token(30, 3, dim, 2, fp8=True)
            == ratio
        )
    shape = ModelShape(num_layers=4, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=4,
                       num_query_groups=2, vocab_size=128, head_dim=128)  # fmt: skip

    def kv_bytes(kv_cache_dtype: str, **rollout: object) -> int:
        rollout = {"max_batch_size": 4096, "kv_cache_dtype": kv_cache_dtype, **rollout}
        cfg = config_from_container({"model": {"source": "tiny", "dtype": "bfloat16"}, "rollout": rollout})
        return mp.memory_model(cfg, shape, 1024, 80 * GIB).kv_cache_bytes

    # a cache of 1000 tokens (63 pages of 16 + the null page) in either dtype
    for dtype in ("bf16", "fp8"):
        assert kv_bytes(dtype, kv_cache_tokens=1000) == 64 * 16 * kv_bytes_per_token(
            4, 2, 128, 2, dtype == "fp8"
        )
    # at a fraction: the same bytes (within a page), 256 / 132 times the tokens
    bf16, fp8 = kv_bytes("bf16", kv_cache_fraction=0.001), kv_bytes("fp8", kv_cache_fraction=0.001)
    assert abs(bf16 - fp8) <= 2 * 16 * kv_bytes_per_token(4, 2, 128, 2, fp8=False)


def test_fp8_pages_are_attended_in_fp16_by_a_16_bit_model_and_in_fp32_by_an_fp32_one():
    assert pa.dot_dtype(torch.bfloat16, FP8, fp8=True) == torch.float16  # e4m3 -> fp16: one instruction
    assert pa.dot_dtype(torch.float16, FP8, fp8=True) == torch.float16
    assert pa.dot_dtype(torch.float32, FP8, fp8=True) == torch.float32
    assert pa.dot_dtype(torch.bfloat16, torch.bfloat16, fp8=False) == torch.bfloat16


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_fp8_pages_with_bf16_queries(device, monkeypatch):
    """A bf16 model's queries over e4m3 pages (the kernel's fp16 dots) against the fp64 reference."""
    monkeypatch.setattr(pa, "BLOCK_N", 16)
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", 16)
    q, k_cache, v_cache, table, lens = _scenario(8, 4, "cpu")
    (kq, vq, ks, vs), (kd, vd) = _fp8_pages(k_cache, v_cache)
    q = q.bfloat16()
    want = _dense(q, kd, vd, table, lens, 0.3)
    args = [t.to(device) for t in (q, kq, vq, table, lens)]
    got = paged_decode_attention(
        *args, 0.3, num_splits=3, use_triton=True, k_scale=ks.to(device), v_scale=vs.to(device)
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=1e-2)
