"""The embedded engine's stream (continuous rollout): a run that stops early keeps its rows and KV
pages and a later run finishes them exactly; tokens sampled after a weight update carry the new
version; cancelled work gives its pages back; a synchronous ``generate`` runs beside carried rows;
a larger cache taken mid-stream resumes the carried rows (CPU, fp32, a real tiny GPT)."""

from __future__ import annotations

import torch

from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.rollout import AdapterVersion
from tests.unit import test_rollout_batching as batching
from tests.unit.test_rollout_batching import _engine_for, _key
from tests.unit.test_rollout_kv_pages import _requests

model, tokenizer = batching.model, batching.tokenizer  # the module-scoped fixtures, shared


def _free_pages_at_rest(engine) -> int:
    return engine._cache.num_pages - 1


def test_a_run_that_stops_early_keeps_its_rows_and_the_next_run_finishes_them_exactly(model, tokenizer):
    requests = _requests(tokenizer)
    want = _engine_for(model, tokenizer, max_batch_size=8).generate(requests)
    engine = _engine_for(model, tokenizer, max_batch_size=8)
    ids = engine.submit(requests)
    state = engine.run(lambda s: len(s.finished) >= 3)
    assert 3 <= len(state.finished) < len(requests)
    assert state.active_rows > 0  # rows still decoding kept their place
    assert engine.in_flight() == len(requests) - len(state.finished)
    engine.run()
    got = engine.take(ids)
    assert [_key(r) for r in got] == [_key(r) for r in want]
    assert all(r.token_versions == [r.version] * len(r.output_ids) for r in got)
    assert engine.in_flight() == 0 and engine._cache.free_pages == _free_pages_at_rest(engine)


def test_tokens_sampled_after_a_weight_update_carry_the_new_version(model, tokenizer):
    requests = [r for r in _requests(tokenizer) if r.adapter == "a"]
    engine = _engine_for(model, tokenizer, max_batch_size=16)
    before = _engine_for(model, tokenizer, max_batch_size=16).generate(requests)
    ids = engine.submit(requests)
    engine.run(lambda s: len(s.finished) >= 1)
    carried = {r.request: r.count for r in engine._stream.rows}
    assert carried
    layers = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
    saved = [layer.lora_B.data[0].clone() for layer in layers]
    try:
        with torch.no_grad():  # an "optimizer step" of slot 0 ("a"), then its new version is published
            for layer in layers:
                layer.lora_B.data[0].mul_(-3.0)
        engine.update_adapters({"a": AdapterVersion(0, 4)})
        engine.run()
        got = engine.take(ids)
    finally:
        with torch.no_grad():
            for layer, b in zip(layers, saved, strict=True):
                layer.lora_B.data[0].copy_(b)
    changed = 0
    for i, (result, old) in enumerate(zip(got, before, strict=True)):
        if i not in carried:  # finished before the update: all old
            assert result.token_versions == [3] * len(result.output_ids)
            assert result.output_ids == old.output_ids
            continue
        n = carried[i]
        assert result.token_versions[:n] == [3] * n  # sampled before the update
        assert set(result.token_versions[n:]) <= {4}
        assert result.output_ids[:n] == old.output_ids[:n]
        changed += result.output_ids != old.output_ids
    assert changed > 0  # the new weights sampled the carried rows' next tokens


def test_cancel_frees_pages_and_generate_runs_beside_carried_rows(model, tokenizer):
    requests = _requests(tokenizer)
    engine = _engine_for(model, tokenizer, max_batch_size=8)
    want = _engine_for(model, tokenizer, max_batch_size=8).generate(requests[:6])
    ids = engine.submit(requests)
    engine.run(lambda s: len(s.finished) >= 2)
    engine.cancel(ids[12:])  # half of the work goes: waiting, decoding or finished
    assert all(r.request < 12 for r in engine._stream.rows + engine._stream.preempted)
    got = engine.generate(requests[:6])  # a synchronous call: the carried rows decode alongside
    assert [_key(r) for r in got] == [_key(r) for r in want]
    engine.run()
    assert sorted(engine._stream.results) == ids[:12]
    engine.take(ids[:12])
    assert engine.in_flight() == 0 and engine._cache.free_pages == _free_pages_at_rest(engine)


def test_a_larger_cache_taken_mid_stream_resumes_the_carried_rows(model, tokenizer):
    requests = _requests(tokenizer)
    want = _engine_for(model, tokenizer, max_batch_size=24).generate(requests[:8])
    engine = _engine_for(model, tokenizer, max_batch_size=24)
    ids = engine.submit(requests[:8])
    engine.run(lambda s: len(s.finished) >= 1)
    pages = engine._cache.num_pages
    engine.submit(requests[8:])  # more rows than the cache was sized for: a new cache (CPU)
    assert engine._cache.num_pages > pages
    engine.run()
    got = engine.take(ids)
    for a, b in zip(got, want, strict=True):
        assert _key(a) == _key(b)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)


def test_a_cpu_cache_is_capped_and_rows_beyond_it_wait_their_turn(model, tokenizer, monkeypatch):
    from miles_multilora.rollout import embedded

    requests = _requests(tokenizer)
    want = _engine_for(model, tokenizer, max_batch_size=8).generate(requests)
    monkeypatch.setattr(embedded, "CPU_KV_CACHE_TOKENS", 96)
    engine = _engine_for(model, tokenizer, max_batch_size=8)
    got = engine.generate(requests)
    longest = max(len(r.prompt_ids) + engine.budget(r) for r in requests) + engine.page_size
    assert (engine._cache.num_pages - 1) * engine.page_size < 8 * longest  # not a full batch's worth
    assert engine.stats["preemptions"] > 0 or engine.stats["peak_rows"] < 8
    for a, b in zip(got, want, strict=True):
        assert _key(a) == _key(b)
