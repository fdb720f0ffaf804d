"""A stream session (``trainer/stream.py``) on real embedded engines (CPU, fp32, a tiny GPT): over
two DP ranks each group decodes on its owner only and ``take`` gives every rank every group's
samples exactly once, in order, as one engine alone samples them; ``cancel`` drops a group."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from miles_multilora.trainer.data_parallel import DPLayout
from miles_multilora.trainer.stream import SampleStream
from tests.fake_rank import FakeWorld
from tests.unit import test_rollout_batching as batching
from tests.unit.test_rollout_batching import _engine_for, _key
from tests.unit.test_rollout_kv_pages import _requests

model, tokenizer = batching.model, batching.tokenizer  # the module-scoped fixtures, shared


def _groups(tokenizer) -> list[list]:
    """Four groups of three samples (two prompts x adapter "a" and the base model)."""
    requests = _requests(tokenizer)[:12]
    return [requests[i : i + 3] for i in range(0, 12, 3)]


@pytest.fixture(scope="module")
def want(model, tokenizer) -> list:
    """The groups' samples from one engine alone, in order."""
    return _engine_for(model, tokenizer, max_batch_size=8).generate(
        [r for g in _groups(tokenizer) for r in g]
    )


def test_each_group_decodes_on_its_owner_and_every_rank_takes_every_result_once(model, tokenizer, want):
    groups = _groups(tokenizer)
    world = FakeWorld(2)
    engines = [_engine_for(model, tokenizer, max_batch_size=8) for _ in range(2)]
    streams = [
        SampleStream(
            engines[r], DPLayout(dp_size=2, dp_rank=r, world_size=2), lambda v, r=r: world.gather(r, v)
        )
        for r in range(2)
    ]
    sent = [stream.submit(groups) for stream in streams]
    for r, engine in enumerate(engines):
        assert [g.owner for g in sent[r]] == [0, 1, 0, 1]
        assert [bool(g.ids) for g in sent[r]] == [g.owner == r for g in sent[r]]
        assert engine.in_flight() == 6  # its own two groups only
        streams[r].run()  # one engine at a time: they share the model
    with ThreadPoolExecutor(2) as pool:
        taken = list(pool.map(lambda r: streams[r].take(sent[r]), range(2)))
    for results in taken:
        assert [_key(x) for group in results for x in group] == [_key(x) for x in want]
    with pytest.raises(KeyError):  # taken out of the stream: once
        engines[0].take(sent[0][0].ids)


def test_cancel_drops_a_group_and_the_others_finish_as_alone(model, tokenizer, want):
    groups = _groups(tokenizer)
    engine = _engine_for(model, tokenizer, max_batch_size=8)
    stream = SampleStream(engine, DPLayout(), lambda v: [v])
    sent = stream.submit(groups)
    state = stream.run(lambda s: sent[0].finished(s))
    assert sent[0].finished(state) and not all(g.finished(state) for g in sent)
    stream.cancel(sent[1:3])
    assert engine.in_flight() == sum(i not in state.finished for g in (sent[0], sent[3]) for i in g.ids)
    stream.run()
    got = stream.take([sent[0], sent[3]])
    assert [_key(x) for group in got for x in group] == [_key(x) for x in want[:3] + want[9:]]
    with pytest.raises(KeyError):  # a cancelled group has no results
        stream.take(sent[1:2])
    assert engine.in_flight() == 0 and engine._cache.free_pages == engine._cache.num_pages - 1
