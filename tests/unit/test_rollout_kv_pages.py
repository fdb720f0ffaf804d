"""KV pages taken as rows grow, and preemption: a cache too small for every row at once preempts
the most recently admitted rows and resumes them later with exactly the outputs of a run that had
room for all; pages are never leaked nor freed twice (CPU, fp32, a real tiny GPT)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.rollout import GenerationRequest, RolloutError, embedded
from miles_multilora.rollout.kv_cache import PagedKVCache
from miles_multilora.rollout.prefill import RowStarter
from miles_multilora.rollout.rows import pages_for
from tests.unit.test_rollout_batching import ADAPTERS, _engine_for, _key
from tests.unit.test_rollout_embedded import _char_tokenizer, _lora_gpt

PAGE = 4
PROMPTS = ["Hi", "ok", "2+3?", "A cat"]


@pytest.fixture(scope="module")
def model():
    from miles_multilora.models.compat import init_distributed

    init_distributed()
    return _lora_gpt(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return _char_tokenizer()


def _requests(tokenizer, stop: list[str] | None = None) -> list[GenerationRequest]:
    """Four prompts x (adapter "a", the base model) x 3 seeded samples, 16-43 new tokens each,
    top-p filtered and plain sampling mixed."""
    requests = []
    for p_index, prompt in enumerate(PROMPTS):
        for a_index, adapter in enumerate(("a", None)):
            for j in range(3):
                spec = SamplingSpec(
                    max_new_tokens=16 + 9 * ((p_index + j + a_index) % 4),
                    temperature=1.0,
                    top_p=0.95 if j else 1.0,
                    stop=list(stop or []),
                )
                ids, seed = tokenizer.encode(prompt), 10 * p_index + j
                if adapter is None:
                    requests.append(GenerationRequest.for_base(ids, spec, seed=seed, uid=p_index, sample=j))
                else:
                    av = ADAPTERS[adapter]
                    requests.append(
                        GenerationRequest(adapter, av.slot, av.version, ids, spec, seed, {"uid": p_index})
                    )
    return requests


def _assert_same(got, want) -> None:
    assert [_key(r) for r in got] == [_key(r) for r in want]
    assert [(r.text, r.metadata, r.seed) for r in got] == [(r.text, r.metadata, r.seed) for r in want]
    for a, b in zip(got, want, strict=True):  # within fp32 rounding: the batches ran other rows
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)


def _count_resumes(monkeypatch) -> Counter:
    resumed: Counter = Counter()
    load = RowStarter._load_resumed

    def counting(self, rows, first):  # noqa: ANN001, ANN202
        resumed.update(r.request for r in rows)
        return load(self, rows, first)

    monkeypatch.setattr(RowStarter, "_load_resumed", counting)
    return resumed


def _all_pages_free(cache: PagedKVCache) -> bool:
    return cache.free_pages == cache.num_pages - 1 and len(set(cache._free)) == cache.free_pages


@pytest.mark.parametrize(("sync_interval", "kv_cache_dtype"), [(1, "bf16"), (3, "bf16"), (3, "fp8")])
def test_preempted_rows_resume_with_the_outputs_of_a_run_with_room_for_all(
    model, tokenizer, monkeypatch, sync_interval, kv_cache_dtype
):
    """fp8 pages too: a resumed row's prefill attends over what its pages hold, as decoding did."""
    free = _engine_for(model, tokenizer, page_size=PAGE, kv_cache_dtype=kv_cache_dtype).generate(
        _requests(tokenizer)
    )
    # a stop string and an EOS id that end some samples mid-way (read off the unconstrained run)
    stop = next(r.text[6:8] for r in free if " " not in r.text[6:8])
    eos = Counter(t for r in free for t in r.output_ids[2:]).most_common(8)[-1][0]
    requests = _requests(tokenizer, stop=[stop])
    kw = dict(page_size=PAGE, eos_token_ids=[eos], sync_interval=sync_interval, kv_cache_dtype=kv_cache_dtype)
    roomy = _engine_for(model, tokenizer, **kw)
    want = roomy.generate(requests)
    assert {r.finish_reason for r in want} == {"eos", "stop", "length"}
    assert roomy.stats["preemptions"] == 0 and roomy.stats["peak_rows"] == len(requests)
    resumed = _count_resumes(monkeypatch)
    tight = _engine_for(model, tokenizer, kv_cache_tokens=56, **kw)
    _assert_same(tight.generate(requests), want)
    assert tight._cache.fp8 == (kv_cache_dtype == "fp8")
    stats = tight.stats
    assert stats["preemptions"] >= 5 and max(resumed.values()) >= 2  # rows preempted more than once
    assert stats["resumed_tokens"] > 0 and stats["peak_pages"] == tight._cache.num_pages - 1
    # pages on demand: more rows at once than reserving each row's whole budget would allow
    reserved = min(pages_for(len(q.prompt_ids) + q.sampling.max_new_tokens, PAGE) for q in requests)
    assert stats["peak_rows"] > (tight._cache.num_pages - 1) // reserved
    assert 0 < stats["row_steps"] / stats["decode_steps"] <= stats["peak_rows"]
    assert _all_pages_free(tight._cache)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_a_groups_shared_prompt_pages_are_freed_exactly_once(model, tokenizer, monkeypatch, kv_cache_dtype):
    prompt = tokenizer.encode("Tell me a story about a cat, please.")  # 9 full pages
    spec = SamplingSpec(max_new_tokens=30, temperature=1.0)
    requests = [GenerationRequest("a", 0, 3, prompt, spec, seed=s) for s in range(4)]
    want = _engine_for(model, tokenizer, page_size=PAGE, kv_cache_dtype=kv_cache_dtype).generate(requests)
    engine = _engine_for(model, tokenizer, page_size=PAGE, kv_cache_tokens=120, kv_cache_dtype=kv_cache_dtype)
    engine._ensure_state(requests)
    cache = engine._cache
    events: list[tuple[str, int]] = []  # (alloc | share | free, page), in order
    alloc, share, release = cache.alloc, cache.share, cache.release

    def logged_alloc(count):  # noqa: ANN001, ANN202
        pages = alloc(count)
        events.extend(("alloc", p) for p in pages)
        return pages

    def logged_share(pages):  # noqa: ANN001, ANN202
        share(pages)
        events.extend(("share", p) for p in pages)

    def logged_release(pages):  # noqa: ANN001, ANN202
        release(pages)
        events.extend(("free", p) for p in pages if cache._refs[p] == 0)

    monkeypatch.setattr(cache, "alloc", logged_alloc)
    monkeypatch.setattr(cache, "share", logged_share)
    monkeypatch.setattr(cache, "release", logged_release)
    _assert_same(engine.generate(requests), want)
    assert engine.stats["preemptions"] >= 1 and engine.stats["prefilled_prompts"] == 1
    for page in [
        p for _, p in events[: len(prompt) // PAGE]
    ]:  # the prompt's pages: held by the 4 samples, freed once
        assert [kind for kind, p in events if p == page][:5] == ["alloc", "share", "share", "share", "free"]
    for page in range(1, cache.num_pages):  # every page: taken, given back, taken, ... given back
        kinds = [kind for kind, p in events if p == page and kind != "share"]
        assert kinds == ["alloc", "free"] * (len(kinds) // 2)
    assert _all_pages_free(cache)


def test_no_pages_leak_across_a_hundred_calls_of_mixed_lengths(model, tokenizer):
    rng = random.Random(0)
    engine = _engine_for(
        model,
        tokenizer,
        page_size=PAGE,
        kv_cache_tokens=32,
        max_batch_size=6,
        eos_token_ids=tokenizer.encode("e"),
        sync_interval=1,  # a host check every step on any device: rows grow (and preempt) alike
    )
    for call in range(100):
        requests = []
        for _ in range(rng.randint(1, 4)):
            spec = SamplingSpec(
                max_new_tokens=rng.randint(1, 10),
                temperature=rng.choice([0.0, 1.0]),
                stop=rng.choice([[], ["a"]]),
            )
            prompt = tokenizer.encode(rng.choice(PROMPTS))
            requests += [GenerationRequest.for_base(prompt, spec, seed=rng.randint(0, 9))] * rng.randint(1, 3)
        results = engine.generate(requests)
        assert all(
            1 <= len(r.output_ids) <= q.sampling.max_new_tokens
            for r, q in zip(results, requests, strict=True)
        )
        assert _all_pages_free(engine._cache), f"call {call}"
    assert engine.stats["preemptions"] > 10


def test_a_request_that_cannot_fit_alone_names_the_setting(model, tokenizer):
    engine = _engine_for(model, tokenizer, page_size=PAGE, kv_cache_tokens=40)
    big = GenerationRequest.for_base(tokenizer.encode("What is 2+3?"), SamplingSpec(max_new_tokens=40))
    with pytest.raises(RolloutError, match=r"needs 52 tokens .* holds 40 \(rollout.kv_cache_tokens=40\)"):
        engine.generate([big])
    fits = GenerationRequest.for_base(tokenizer.encode("What is 2+3?"), SamplingSpec(max_new_tokens=25))
    results = engine.generate([fits] * 3)  # each alone: fits; all three at once: preempted in turn
    assert len({tuple(r.output_ids) for r in results}) == 1 and len(results[0].output_ids) == 25
    assert engine.stats["preemptions"] > 0 and _all_pages_free(engine._cache)


def test_at_the_same_fraction_an_fp8_cache_takes_the_tokens_its_smaller_pages_allow(
    model, tokenizer, monkeypatch
):
    """The GPU sizing (``rollout.kv_cache_fraction`` of the device's memory, in tokens) divides by
    bytes per token that count what the cache allocates: e4m3 values plus a scale per head."""
    engines = {
        d: _engine_for(model, tokenizer, page_size=PAGE, max_batch_size=10**7, kv_cache_dtype=d)
        for d in ("bf16", "fp8")
    }
    for engine in engines.values():
        assert engine.paged.new_cache(10, PAGE).nbytes == 10 * PAGE * engine.paged.kv_bytes_per_token()
        engine.device = torch.device("cuda")  # size it as on a 1 GiB GPU (not bound by rows x context)
    monkeypatch.setattr(embedded, "device_memory", lambda _: 2**30)
    tokens = {d: engine._capacity_tokens() for d, engine in engines.items()}
    dim = engines["fp8"].paged.head_dim  # fp32 model: 4 bytes a value against 1 + 4 / dim
    assert tokens["fp8"] / tokens["bf16"] == pytest.approx(4 * dim / (dim + 4), rel=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_replayed_graphs_preempt_and_resume_with_the_same_samples(tokenizer, monkeypatch, kv_cache_dtype):
    """On CUDA (graphs, host checks every 8 steps, pages allocated ahead for them), a cache that
    preempts gives the samples of one with room for every row (fp8: the fused RoPE kernel writes
    e4m3 pages and the Triton kernel reads them inside the graphs)."""
    from miles_multilora.models.compat import init_distributed

    init_distributed()
    model = _lora_gpt(seed=1).cuda()
    requests = _requests(tokenizer, stop=["e "])
    kw = dict(page_size=8, cuda_graphs=True, sync_interval=8, kv_cache_dtype=kv_cache_dtype)
    roomy = _engine_for(model, tokenizer, **kw)
    want = roomy.generate(requests)
    resumed = _count_resumes(monkeypatch)
    tight = _engine_for(model, tokenizer, kv_cache_tokens=64, **kw)
    _assert_same(tight.generate(requests), want)
    assert roomy.stats["preemptions"] == 0 and tight.stats["preemptions"] >= 3 and resumed
    assert tight._graphs.captures >= 1 and _all_pages_free(tight._cache)


def test_switching_the_cache_dtype_between_runs_gives_the_runs_of_engines_built_with_it(model, tokenizer):
    """``use_kv_cache_dtype`` (benchmarks compare bf16 and fp8 pages in one process): each run after
    a switch has exactly the outputs of an engine made with that dtype; a switch with requests in
    flight is refused and changes nothing."""
    requests = _requests(tokenizer)[:6]
    want = {
        d: _engine_for(model, tokenizer, page_size=PAGE, kv_cache_dtype=d).generate(requests)
        for d in ("bf16", "fp8")
    }
    assert [r.output_ids for r in want["bf16"]] != [r.output_ids for r in want["fp8"]]  # the dtype matters
    engine = _engine_for(model, tokenizer, page_size=PAGE)
    for d in ("bf16", "fp8", "bf16", "fp8"):
        engine.use_kv_cache_dtype(d)
        _assert_same(engine.generate(requests), want[d])
        assert engine._cache.fp8 == (d == "fp8") and _all_pages_free(engine._cache)
    engine.submit(requests[:1])
    with pytest.raises(RolloutError, match="between runs"):
        engine.use_kv_cache_dtype("bf16")
    assert engine.paged.fp8 and engine._cache.fp8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        _engine_for(model, tokenizer).use_kv_cache_dtype("int8")
