"""The embedded engine's scheduling: continuous batching, shared prompt prefill, host checks every
k steps with exact stop truncation, the KV budget, and (on a GPU) replayed CUDA graphs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.rollout import AdapterVersion, GenerationRequest, RolloutError
from tests.unit.test_rollout_embedded import _char_tokenizer, _engine, _lora_gpt

ADAPTERS = {"a": AdapterVersion(0, 3), "b": AdapterVersion(2, 1)}


@pytest.fixture(scope="module")
def model():
    from miles_multilora.models.compat import init_distributed

    init_distributed()
    return _lora_gpt(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return _char_tokenizer()


def _grpo_requests(tokenizer, n_samples: int = 3, **sampling) -> list[GenerationRequest]:
    """Prompts x samples for two adapters and the base model, varied budgets, seeds per sample."""
    prompts = ["What is 2+3?", "Hi", "Tell me a story about a cat.", "ok", "Seven plus nine equals"]
    requests = []
    for p_index, prompt in enumerate(prompts):
        for adapter in ("a", "b", None):
            for j in range(n_samples):
                spec = SamplingSpec(max_new_tokens=6 + 3 * ((p_index + j) % 5), **sampling)
                ids = tokenizer.encode(prompt)
                if adapter is None:
                    req = GenerationRequest.for_base(ids, spec, seed=100 * p_index + j, uid=p_index, sample=j)
                else:
                    av = ADAPTERS[adapter]
                    req = GenerationRequest(adapter, av.slot, av.version, ids, spec, seed=100 * p_index + j)
                    req.metadata = {"uid": p_index, "sample": j}
                requests.append(req)
    return requests


def _engine_for(model, tokenizer, **kw):
    engine = _engine(model, tokenizer, **kw)
    engine.update_adapters(ADAPTERS)
    return engine


def _key(result) -> tuple:
    return (result.adapter, result.version, result.slot, tuple(result.output_ids), result.finish_reason)


def test_continuous_batching_returns_every_request_once_with_its_tag_and_the_same_samples(model, tokenizer):
    requests = _grpo_requests(tokenizer)
    wide = _engine_for(model, tokenizer, max_batch_size=64).generate(requests)
    narrow_engine = _engine_for(model, tokenizer, max_batch_size=4)
    narrow = narrow_engine.generate(requests)
    assert len(narrow) == len(requests) and all(r is not None for r in narrow)
    for req, a, b in zip(requests, wide, narrow, strict=True):
        assert (b.adapter, b.slot, b.version, b.metadata) == (
            req.adapter,
            req.slot,
            req.version,
            req.metadata,
        )
        assert b.prompt_ids == req.prompt_ids and 1 <= len(b.output_ids) <= req.sampling.max_new_tokens
        assert _key(a) == _key(b)  # the batch a row ran in never changes its sample
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
    cache = narrow_engine._cache
    assert cache.free_pages == cache.num_pages - 1  # every page came back
    assert narrow_engine.stats["decode_steps"] > wide_steps(requests)  # rows were refilled, not waited on


def wide_steps(requests) -> int:
    return max(r.sampling.max_new_tokens for r in requests) - 1


def test_a_prompts_samples_prefill_once_and_share_its_pages(model, tokenizer):
    requests = _grpo_requests(tokenizer, n_samples=4)
    engine = _engine_for(model, tokenizer, max_batch_size=64)
    shared = engine.generate(requests)
    unique = {(r.adapter, r.version, tuple(r.prompt_ids)) for r in requests}
    assert engine.stats["prefilled_prompts"] == len(unique) < len(requests)
    alone = [_engine_for(model, tokenizer, max_batch_size=1).generate([r])[0] for r in requests[:12]]
    for a, b in zip(shared[:12], alone, strict=True):
        assert _key(a) == _key(b)
    samples = {tuple(r.output_ids) for r in shared if (r.adapter, r.metadata["uid"]) == ("a", 2)}
    assert len(samples) > 1  # different seeds, same shared prompt: different samples


@pytest.mark.parametrize("interval", [3, 7])
def test_host_checks_every_k_steps_keep_stop_truncation_and_finish_reasons(model, tokenizer, interval):
    requests = _grpo_requests(tokenizer, stop=["e", "a "], temperature=1.0)
    every_step = _engine_for(model, tokenizer, max_batch_size=8, sync_interval=1).generate(requests)
    every_k = _engine_for(model, tokenizer, max_batch_size=8, sync_interval=interval).generate(requests)
    assert [_key(r) for r in every_step] == [_key(r) for r in every_k]
    reasons = {r.finish_reason for r in every_k}
    assert "stop" in reasons and "length" in reasons
    for r in every_k:
        if r.finish_reason == "stop":  # truncated right after the token that completed the stop string
            assert any(s in r.text for s in ("e", "a ")) and not any(
                s in tokenizer.decode(r.output_ids[:-1]) for s in ("e", "a ")
            )


def test_eos_ends_rows_on_the_device(model, tokenizer):
    requests = _grpo_requests(tokenizer, temperature=1.0)
    sampled = Counter(t for r in _engine_for(model, tokenizer).generate(requests) for t in r.output_ids)
    eos = [t for t, _ in sampled.most_common(3)]  # frequent tokens: rows end at varied points
    results = _engine_for(model, tokenizer, eos_token_ids=eos, sync_interval=4).generate(requests)
    for r in results:
        assert (r.finish_reason == "eos") == (r.output_ids[-1] in eos)
        assert all(t not in eos for t in r.output_ids[:-1])
    assert any(r.finish_reason == "eos" for r in results)


def test_a_request_larger_than_the_kv_budget_is_refused_with_the_setting_to_change(model, tokenizer):
    engine = _engine_for(model, tokenizer, kv_cache_tokens=32, page_size=8)
    ok = GenerationRequest.for_base(tokenizer.encode("Hi"), SamplingSpec(max_new_tokens=20))
    big = GenerationRequest.for_base(tokenizer.encode("Hi there"), SamplingSpec(max_new_tokens=40))
    with pytest.raises(RolloutError, match="rollout.kv_cache_tokens"):
        engine.check_request(big)
    with pytest.raises(RolloutError, match="rollout.kv_cache_tokens"):
        engine.generate([ok, big])
    results = engine.generate([ok] * 5)  # more than fit at once: they wait for pages, then run
    assert all(len(r.output_ids) == 20 for r in results) and len({tuple(r.output_ids) for r in results}) == 1


def test_the_default_kv_cache_fits_the_call_and_grows_only_when_a_larger_one_comes(model, tokenizer):
    """CPU: a full batch of the call's longest request, grown by a larger call. GPU: a fixed share
    of its memory (at most every row at full context), since pages are taken as rows grow."""
    engine = _engine_for(model, tokenizer, max_batch_size=8, page_size=4)
    small = [
        GenerationRequest.for_base(tokenizer.encode("Hi"), SamplingSpec(max_new_tokens=5), seed=i)
        for i in range(2)
    ]
    first = engine.generate(small)
    pages = engine._cache.num_pages
    if engine.device.type == "cuda":
        assert (pages - 1) * engine.page_size >= engine._capacity_tokens()  # + the null page
        engine.generate(small * 4)
        assert engine._cache.num_pages == pages
        assert [r.output_ids for r in engine.generate(small)] == [r.output_ids for r in first]
        return
    assert (
        pages * engine.page_size < engine.max_batch_size * engine.max_seq_len
    )  # not every row at full context
    engine.generate(small * 4)  # a larger call: the cache grows, and the small call's results stay the same
    assert engine._cache.num_pages > pages
    grown = engine._cache.num_pages
    assert [r.output_ids for r in engine.generate(small)] == [r.output_ids for r in first]
    assert engine._cache.num_pages == grown  # never shrinks (the CUDA graphs keep their buffers)


@pytest.mark.gpu
def test_graph_replay_equals_eager_decode_and_follows_weight_updates(tokenizer):
    from miles_multilora.models.compat import init_distributed

    init_distributed()
    model = _lora_gpt(seed=1).cuda()
    requests = _grpo_requests(tokenizer, temperature=1.0, stop=["e"])
    graphs = _engine_for(model, tokenizer, cuda_graphs=True, sync_interval=4)
    eager = _engine_for(model, tokenizer, cuda_graphs=False, sync_interval=4)
    first = graphs.generate(requests)
    assert [_key(r) for r in first] == [_key(r) for r in eager.generate(requests)]
    assert graphs._graphs.captures >= 1
    with torch.no_grad():  # an optimizer step writes the weights in place: replays must see it
        for layer in multi_lora_layers(model):
            layer.lora_B[0].mul_(-3.0)
    captures = graphs._graphs.captures
    after = graphs.generate(requests)
    assert [_key(r) for r in after] == [_key(r) for r in eager.generate(requests)]
    assert [_key(r) for r in after] != [_key(r) for r in first] and graphs._graphs.captures == captures
    model.to(torch.float64).to(torch.float32)  # reallocates every parameter: graphs must be recaptured
    again = graphs.generate(requests)
    assert [_key(r) for r in again] == [_key(r) for r in eager.generate(requests)]
    assert graphs._graphs.captures > captures


@pytest.mark.gpu
def test_the_decode_lora_schedules_give_the_same_samples(tokenizer, monkeypatch):
    """The LoRA on the side stream (its term added by the consumer kernels), the dense shrink, fc1's
    expand run by the SwiGLU (with and without the side stream), and the shrink taken from the
    stacked base GEMM (expand in place, or by the SwiGLU) give the tokens of the plain schedule, and
    logprobs within fp32 rounding (the sums are ordered differently), on a model whose adapters
    change the samples."""
    from miles_multilora.lora import MultiLoRALinear, stacked_shrink
    from miles_multilora.models.compat import init_distributed
    from miles_multilora.rollout import decode_batch, decode_fusions

    init_distributed()
    model = _lora_gpt(seed=2).cuda()
    requests = _grpo_requests(tokenizer, temperature=1.0)
    results = {}
    expands_in_swiglu, stacked_gemms = [], []
    run_expand = decode_fusions._swiglu_expand
    monkeypatch.setattr(
        decode_fusions, "_swiglu_expand", lambda *args: expands_in_swiglu.append(1) or run_expand(*args)
    )
    run_stacked = MultiLoRALinear._stacked_forward
    monkeypatch.setattr(
        MultiLoRALinear, "_stacked_forward", lambda *args: stacked_gemms.append(1) or run_stacked(*args)
    )
    monkeypatch.setattr(stacked_shrink, "MAX_EXTRA_FRACTION", 1.0)  # the tiny model's every linear
    never = 1 << 30
    for name, overlap, dense_min_slots, swiglu_min_rows, stacked_min_rows in (
        ("plain", False, never, never, never),
        ("side", True, never, never, never),
        ("dense", True, 1, never, never),
        ("swiglu", False, never, 0, never),
        ("side+swiglu", True, never, 0, never),
        ("stacked", False, never, never, 0),
        ("stacked+swiglu", False, never, 0, 0),
    ):
        monkeypatch.setattr(decode_batch, "LORA_SIDE_STREAM", overlap)
        monkeypatch.setattr(decode_batch, "LORA_DENSE_MIN_SLOTS", dense_min_slots)
        monkeypatch.setattr(decode_batch, "LORA_EXPAND_IN_SWIGLU_MIN_ROWS", swiglu_min_rows)
        monkeypatch.setattr(decode_batch, "LORA_STACKED_MIN_ROWS", stacked_min_rows)
        engine = _engine_for(model, tokenizer, cuda_graphs=True, sync_interval=4)
        expands_in_swiglu.clear()
        stacked_gemms.clear()
        results[name] = engine.generate(requests)
        assert bool(expands_in_swiglu) == (swiglu_min_rows == 0)  # captured with the path asked for
        assert bool(stacked_gemms) == (stacked_min_rows == 0)
        assert (engine._batch.side_stream is not None) == overlap
        assert any(dense for _, _, dense in engine._graphs._graphs) == (name == "dense")
    for name in ("side", "dense", "swiglu", "side+swiglu", "stacked", "stacked+swiglu"):
        assert [_key(r) for r in results[name]] == [_key(r) for r in results["plain"]]
        got = [lp for r in results[name] for lp in r.logprobs]
        want = [lp for r in results["plain"] for lp in r.logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the stacked schedule's graphs read lora_A's copy: an in-place write shows
        for layer in multi_lora_layers(model):
            layer.lora_A.mul_(-1.0)
    flipped = engine.generate(requests)
    assert [_key(r) for r in flipped] != [_key(r) for r in results["plain"]]
    monkeypatch.setattr(decode_batch, "LORA_STACKED_MIN_ROWS", never)
    plain = _engine_for(model, tokenizer, cuda_graphs=True, sync_interval=4).generate(requests)
    assert [_key(r) for r in flipped] == [_key(r) for r in plain]
    with torch.no_grad():
        for layer in multi_lora_layers(model):
            layer.lora_B.zero_()
    assert [_key(r) for r in engine.generate(requests)] != [_key(r) for r in results["plain"]]
