"""Shared-prefix decode attention (rollout/shared_prefix.py) equals today's per-row paged attention.

Rows of a group hold the same physical leading pages (as a prompt's samples do), of several prefix
lengths; some rows share nothing, one group is larger than a prefix program takes, rows end inside a
page. The PyTorch path runs everywhere; the Triton kernels run under Triton's interpreter on a CPU
(``TRITON_INTERPRET=1``, set by conftest) and compiled on a GPU (``gpu``), in a CUDA graph too.
"""

from __future__ import annotations

import os

import pytest
import torch

from miles_multilora.rollout.kv_quant import keys_contiguous, quantize
from miles_multilora.rollout.paged_attention import HAVE_TRITON, paged_decode_attention
from miles_multilora.rollout.shared_prefix import (
    MAX_GROUP_ROWS,
    PrefixGroups,
    plan_prefix_groups,
    shared_prefix_attention,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
PAGE, KV_HEADS, DIM = 8, 2, 16
# (shared prompt keys, each member's keys): a group of 3 rows sharing 2 whole pages and a partial
# third (the partial page is each row's own), a group of 10 (cut in two) sharing 1 page, a pair
# sharing 3 whole pages exactly, and two rows of their own (one shorter than a page)
GROUPS = [(2 * PAGE + 5, [2 * PAGE + 6, 3 * PAGE + 1, 4 * PAGE]), (PAGE, [PAGE + 1 + i for i in range(10)])]
GROUPS += [(3 * PAGE, [3 * PAGE + 1, 3 * PAGE + 9]), (0, [5]), (0, [2 * PAGE + 3])]


def _scenario(group: int, seed: int = 0, device: str = "cpu", fp8: bool = False):
    """Caches with shuffled pages (unused slots NaN), block tables whose groups share their prompt's
    whole pages, the queries, lengths and the planned grouping."""
    gen = torch.Generator().manual_seed(seed)
    rows = [(prompt, n) for prompt, members in GROUPS for n in members]
    max_pages = max(-(-n // PAGE) for _, n in rows)
    num_pages = 1 + sum(-(-n // PAGE) for _, n in rows)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(rows), max_pages, dtype=torch.int32)
    b = 0
    for prompt, members in GROUPS:
        shared = [free.pop() for _ in range(prompt // PAGE)]
        for n in members:
            own = [free.pop() for _ in range(-(-n // PAGE) - len(shared))]
            table[b, : len(shared) + len(own)] = torch.tensor(shared + own, dtype=torch.int32)
            b += 1
    k_cache = torch.full((num_pages, PAGE, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, (_, n) in enumerate(rows):
        for i in range(n):  # a shared page is written by each member alike (same values: same seed)
            page, off = table[b, i // PAGE], i % PAGE
            g = torch.Generator().manual_seed(1000 * page.item() + off)
            k_cache[page, off] = torch.randn(KV_HEADS, DIM, generator=g)
            v_cache[page, off] = torch.randn(KV_HEADS, DIM, generator=g)
    q = torch.randn(len(rows), KV_HEADS * group, DIM, generator=gen)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    k_scale = v_scale = None
    if fp8:
        k_cache, k_scale = quantize(k_cache.nan_to_num(0.0))
        v_cache, v_scale = quantize(v_cache.nan_to_num(0.0))
        v_cache = keys_contiguous(v_cache)  # e4m3 value pages as the cache lays them out
    pages = [[p for p in row.tolist() if p] for row in table]
    groups = PrefixGroups.empty(len(rows), torch.device(device))
    groups.set(*plan_prefix_groups(pages, lens.tolist(), PAGE))
    moved = [
        t.to(device) if t is not None else None for t in (q, k_cache, v_cache, table, lens, k_scale, v_scale)
    ]
    return (*moved, groups)


def test_plan_groups_whole_shared_pages_only() -> None:
    """Groups hold the rows of a shared first page, cut at MAX_GROUP_ROWS; the prefix is the whole
    pages all of them hold and have filled; rows sharing nothing belong to no group."""
    *_, lens, _, _, groups = _scenario(group=1)
    assert groups.prefix_lens.tolist() == [2 * PAGE] * 3 + [PAGE] * 10 + [3 * PAGE] * 2 + [0, 0]
    members = [[m for m in row if m >= 0] for row in groups.members.tolist()]
    assert members[:4] == [[0, 1, 2], list(range(3, 3 + MAX_GROUP_ROWS)), [11, 12], [13, 14]]
    assert all(not m for m in members[4:]) and groups.group_lens.tolist()[:5] == [16, 8, 8, 24, 0]
    # pages not yet filled by every member are not shared: a member that has written one key
    assert plan_prefix_groups([[5, 6], [5, 6]], [PAGE + 3, 1], PAGE) == ([0, 0], [], [])


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_torch_matches_per_row_attention(group: int, fp8: bool) -> None:
    q, k, v, table, lens, ks, vs, groups = _scenario(group, fp8=fp8)
    expected = paged_decode_attention(q, k, v, table, lens, 0.3, use_triton=False, k_scale=ks, v_scale=vs)
    got = shared_prefix_attention(q, k, v, table, lens, 0.3, groups, use_triton=False, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_rows_past_the_plan_and_empty_rows() -> None:
    """Rows a run pads the batch with (no keys, no group) give zeros, as today's attention does."""
    q, k, v, table, lens, _, _, groups = _scenario(2)
    lens = torch.cat([lens, torch.zeros(3, dtype=torch.int32)])
    table = torch.cat([table, torch.zeros(3, table.shape[1], dtype=torch.int32)])
    q = torch.cat([q, torch.randn(3, *q.shape[1:])])
    padded = PrefixGroups.empty(q.shape[0], q.device)
    padded.set(groups.prefix_lens.tolist(), [[m for m in g if m >= 0] for g in groups.members.tolist()[:4]],
               groups.group_lens.tolist()[:4])  # fmt: skip
    got = shared_prefix_attention(q, k, v, table, lens, 0.3, padded, use_triton=False)
    torch.testing.assert_close(got, paged_decode_attention(q, k, v, table, lens, 0.3, use_triton=False))
    assert not got[-3:].any()


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("group", "fp8", "splits"), [(1, False, 1), (4, False, 3), (2, True, 2)])
def test_triton_matches_per_row_attention(device: str, group: int, fp8: bool, splits: int) -> None:
    q, k, v, table, lens, ks, vs, groups = _scenario(group, device=device, fp8=fp8)
    expected = paged_decode_attention(q, k, v, table, lens, 0.3, use_triton=False, k_scale=ks, v_scale=vs)
    got = shared_prefix_attention(
        q, k, v, table, lens, 0.3, groups, num_splits=splits, use_triton=True, k_scale=ks, v_scale=vs
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replays_a_new_grouping(fp8: bool) -> None:
    """bf16 on the GPU, captured once, replayed after the grouping and the queries changed."""
    q, k, v, table, lens, ks, vs, groups = _scenario(4, device="cuda", fp8=fp8)
    if not fp8:
        k, v = k.nan_to_num(0.0).bfloat16(), v.nan_to_num(0.0).bfloat16()
    q = q.bfloat16()
    shared_prefix_attention(q, k, v, table, lens, 0.3, groups, k_scale=ks, v_scale=vs)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = shared_prefix_attention(q, k, v, table, lens, 0.3, groups, k_scale=ks, v_scale=vs)
    q.copy_(torch.randn_like(q))
    groups.set([0] * q.shape[0], [], [])  # nothing shared: the suffix pass alone
    graph.replay()
    expected = paged_decode_attention(q, k, v, table, lens, 0.3, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    _, _, _, _, _, _, _, planned = _scenario(4, device="cuda", fp8=fp8)
    for t, s in zip(groups.tensors(), planned.tensors(), strict=True):
        t.copy_(s)
    graph.replay()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny():
    from miles_multilora.models.compat import init_distributed
    from tests.unit.test_rollout_embedded import _char_tokenizer, _lora_gpt

    init_distributed()
    return _lora_gpt(seed=0), _char_tokenizer()


def _group_requests(tokenizer) -> list:
    """Two prompts of several full pages x 4 samples (greedy, seeded, top-p), and one short prompt."""
    from miles_multilora.config.adapter import SamplingSpec
    from miles_multilora.rollout import GenerationRequest
    from tests.unit.test_rollout_batching import ADAPTERS

    requests = []
    for p, prompt in enumerate(["Tell me a story about a cat.", "Add 2 and 3, then 4!", "Hi"]):
        for j in range(4 if p < 2 else 2):
            spec = SamplingSpec(
                max_new_tokens=8 + 3 * j, temperature=0.0 if j == 0 else 1.0, top_p=0.9 if j == 3 else 1.0
            )
            av = ADAPTERS["a"]
            requests.append(
                GenerationRequest("a", av.slot, av.version, tokenizer.encode(prompt), spec, 7 * p + j, {})
            )
    return requests


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kv_cache_tokens"),
    [
        ("bf16", 0),
        pytest.param("fp8", 0, marks=pytest.mark.slow),
        pytest.param("bf16", 64, marks=pytest.mark.slow),
    ],
)
def test_generation_with_shared_prefix_attention_matches_without(
    tiny, monkeypatch, kv_cache_dtype, kv_cache_tokens
):
    """fp32 CPU: the same tokens (greedy and seeded sampling) with the knob on, groups really shared
    (and with a tight cache, rows preempted and resumed on pages of their own)."""
    from miles_multilora.rollout import decode_batch
    from tests.unit.test_rollout_batching import _engine_for, _key

    model, tokenizer = tiny
    planned: list = []
    plan = decode_batch.plan_prefix_groups

    def recording(*args):  # noqa: ANN002, ANN202
        planned.append(plan(*args))
        return planned[-1]

    monkeypatch.setattr(decode_batch, "plan_prefix_groups", recording)
    kw = dict(page_size=4, kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=kv_cache_tokens, sync_interval=2)
    requests = _group_requests(tokenizer)
    off = _engine_for(model, tokenizer, **kw).generate(requests)
    assert not planned
    engine = _engine_for(model, tokenizer, shared_prefix_attention=True, **kw)
    on = engine.generate(requests)
    assert [_key(r) for r in on] == [_key(r) for r in off]
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
    sizes = [len(g) for _, groups, lens in planned for g, n in zip(groups, lens, strict=True) if n >= 8]
    assert max(sizes) == 4  # a prompt's four samples read its (>= 2) shared pages together
    assert (engine.stats["preemptions"] > 0) == (kv_cache_tokens > 0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_replayed_graphs_with_shared_prefix_attention_give_the_same_samples(tiny, kv_cache_dtype):
    """On CUDA (fp32 model, graphs replayed, host checks every 3 steps, a cache that preempts): the
    Triton kernels inside the graphs give the samples of the per-row kernel."""
    from tests.unit.test_rollout_batching import _engine_for, _key
    from tests.unit.test_rollout_embedded import _lora_gpt

    model, tokenizer = _lora_gpt(seed=1).cuda(), tiny[1]
    requests = _group_requests(tokenizer)
    kw = dict(
        page_size=4, cuda_graphs=True, sync_interval=3, kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=64
    )
    off = _engine_for(model, tokenizer, **kw).generate(requests)
    engine = _engine_for(model, tokenizer, shared_prefix_attention=True, **kw)
    on = engine.generate(requests)
    assert [_key(r) for r in on] == [_key(r) for r in off]
    assert engine._graphs.captures >= 1 and engine._batch.groups is not None
