"""Sampling batched across Tinker clients (tiny model, fp32 CPU): the sample parts of several
clients run as one engine call with mixed slots; each request gets exactly what it gets alone, a
part that fails fails alone, a client with many samples queued delays a small one by at most
one engine call, and parts queued while a call decodes join it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.models import compat
from miles_multilora.rollout import GenerationRequest, GenerationResult, RolloutError
from miles_multilora.tinker import sample_joins
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue, SamplePart
from miles_multilora.tinker.requests import Datum, ForwardBackwardRequest, SampleRequest, TinkerError
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config

TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3]
SPEC = SamplingSpec(temperature=1.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerBackend]:
    """Models ``a``, ``b`` and ``c`` one optimizer step away from their init (their LoRAs move the
    distribution), in three slots."""
    root = tmp_path_factory.mktemp("sampling")
    cfg = tiny_run_config(
        root / "run", [], lora={"num_slots": 3, "max_rank": 8}, trainer={"micro_batch_size": 4}
    )
    rank = TrainerRank(cfg)
    try:
        backend = TinkerBackend(rank)
        for seed, model in enumerate("abc", start=1):
            backend.create_model(model, rank=4, seed=seed)
            datum = Datum(TEXT[:-1], {"target_tokens": TEXT[1:], "weights": [1.0] * (len(TEXT) - 1)})
            backend.forward_backward([ForwardBackwardRequest(model, [datum])])
            backend.optim_step(model, lr=3e-2)
        yield backend
    finally:
        compat.destroy_distributed()


def _held(queue: BatchingQueue) -> threading.Event:
    """Hold the queue's worker until the returned event is set (so that what is queued meanwhile
    is there when the next batch is made)."""
    gate = threading.Event()
    queue.submit(gate.wait)
    return gate


def _same(x: list[GenerationResult], y: list[GenerationResult]) -> None:
    assert [r.output_ids for r in x] == [r.output_ids for r in y]
    assert [r.logprobs for r in x] == [r.logprobs for r in y]  # exactly: not approximately
    assert [r.finish_reason for r in x] == [r.finish_reason for r in y]


def _sampled_together(
    queue: BatchingQueue, requests: list[SampleRequest], alone: list[list[GenerationResult]]
) -> None:
    """Queue ``requests`` (a session each) while the worker is held, then check that each gets
    exactly what it got alone."""
    gate = _held(queue)
    futures = [queue.submit_calls((f"t-{i}", "s"), [SamplePart(r)]) for i, r in enumerate(requests)]
    gate.set()
    for future, expected in zip(futures, alone, strict=True):
        _same(future.result(timeout=120), expected)


def test_a_sample_is_the_same_alone_and_batched_with_other_clients(backend: TinkerBackend) -> None:
    mine = SampleRequest("a", TEXT[:4], 3, SPEC, seed=7)
    others = [
        SampleRequest("b", TEXT[2:9], 4, SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=30), seed=3),
        SampleRequest(None, TEXT[5:7], 2, SamplingSpec(temperature=1.2, max_new_tokens=16), seed=7),
        SampleRequest("c", TEXT[:4], 3, SPEC, seed=7),  # same prompt and seeds, another model
    ]
    alone = {r.model_id: backend.sample_many([r])[0] for r in [mine, *others]}
    queue = BatchingQueue(backend, window_s=0.0)
    try:
        gate = _held(queue)
        futures = [
            queue.submit_calls((f"t-{i}", "s"), [SamplePart(r)])
            for i, r in enumerate([others[0], mine, *others[1:]])
        ]
        gate.set()
        batched = [f.result(timeout=120) for f in futures]
    finally:
        queue.close()
    assert queue.sample_batches == [4]  # the four clients' requests ran as one engine call
    for request, got in zip([others[0], mine, *others[1:]], batched, strict=True):
        assert len(got) == request.num_samples
        _same(got, alone[request.model_id])
    # the batch did mix slots: the same prompt and seeds give other tokens on another model
    assert [r.output_ids for r in alone["a"]] != [r.output_ids for r in alone["c"]]
    assert {r.slot for r in batched[1]} == {backend.model("a").slot}


def test_a_failing_part_fails_alone(backend: TinkerBackend) -> None:
    good = SampleRequest("a", TEXT[:5], 2, SPEC, seed=1)
    alone = backend.sample_many([good])[0]

    def stale() -> str | None:
        raise TinkerError("sampler", "the sampler serves an old version")

    backend.create_model("gone", rank=4, seed=9)
    queue = BatchingQueue(backend, window_s=0.0)
    try:
        gate = _held(queue)
        checked = queue.submit_calls(("t-1", "s"), [SamplePart(SampleRequest("b", TEXT[:5], 2, SPEC), stale)])
        ok = queue.submit_calls(("t-2", "s"), [SamplePart(good)])
        unloaded = queue.submit_calls(("t-3", "s"), [SamplePart(SampleRequest("gone", TEXT[:5], 2, SPEC))])
        too_long = queue.submit_calls(
            ("t-4", "s"), [SamplePart(SampleRequest("c", [1] * backend.rank.max_seq_len, 1, SPEC))]
        )
        backend.unload_model("gone")  # after it was queued, before its batch runs
        gate.set()
        with pytest.raises(TinkerError, match="old version"):
            checked.result(timeout=120)
        with pytest.raises(TinkerError, match="unknown model 'gone'"):
            unloaded.result(timeout=120)
        with pytest.raises(TinkerError, match="leaves no room in the context window"):
            too_long.result(timeout=120)
        _same(ok.result(timeout=120), alone)
    finally:
        queue.close()
    assert queue.sample_batches == [3]  # the check failed before the call; the backend refused two


def test_a_small_clients_sample_waits_for_one_engine_call_of_a_big_ones(backend: TinkerBackend) -> None:
    part = 2 * SPEC.max_new_tokens  # two samples of 24 tokens
    queue = BatchingQueue(backend, window_s=0.0, sample_batch_tokens=2 * part, join_sampling=False)
    try:  # two parts per call (joining a running call: test_parts_queued_during_an_engine_call_join_it)
        big = queue.submit_calls(
            ("t-big", "s"),
            [SamplePart(SampleRequest("a", TEXT[:4], 2, SPEC, seed=2 * i)) for i in range(16)],
            combine=lambda parts: [r for p in parts for r in p],
            costs=[part] * 16,
        )
        while not queue.sample_batches:  # the big request is running
            time.sleep(0.001)
        sent_at = len(queue.sample_batches)
        small = queue.submit_calls(
            ("t-small", "s"), [SamplePart(SampleRequest("b", TEXT[:3], 1, SPEC))], costs=[24]
        )
        small.result(timeout=120)
        assert len(queue.sample_batches) - sent_at <= 2  # the call running when it came, then its own
        assert not big.done()
        assert len(big.result(timeout=120)) == 32  # every part, in order, seeded as sent
    finally:
        queue.close()
    assert max(queue.sample_batches) == 2  # sample_batch_tokens bounds each engine call


def test_batch_sampling_off_runs_one_part_per_engine_call(backend: TinkerBackend) -> None:
    requests = [SampleRequest(m, TEXT[:4], 2, SPEC, seed=5) for m in "abc"]
    alone = [backend.sample_many([r])[0] for r in requests]
    queue = BatchingQueue(backend, window_s=0.0, batch_sampling=False)
    try:
        _sampled_together(queue, requests, alone)
    finally:
        queue.close()
    assert queue.sample_batches == [1, 1, 1]


def test_a_short_sample_is_answered_when_it_ends_not_when_its_engine_call_does(
    backend: TinkerBackend,
) -> None:
    long = SampleRequest("a", TEXT[:4], 2, SamplingSpec(temperature=1.0, max_new_tokens=160), seed=1)
    short = SampleRequest("b", TEXT[:4], 1, SamplingSpec(temperature=1.0, max_new_tokens=4), seed=1)
    queue = BatchingQueue(backend, window_s=0.0)
    finished: list[str] = []
    try:
        gate = _held(queue)
        futures = {
            name: queue.submit_calls((f"t-{name}", "s"), [SamplePart(r)])
            for name, r in [("long", long), ("short", short)]
        }
        for name, future in futures.items():
            future.add_done_callback(lambda _, name=name: finished.append(name))
        gate.set()
        results = {name: future.result(timeout=120) for name, future in futures.items()}
    finally:
        queue.close()
    assert queue.sample_batches == [2]  # one engine call ...
    assert finished == ["short", "long"]  # ... whose short request was answered first
    assert len(results["short"][0].output_ids) == 4
    assert max(len(r.output_ids) for r in results["long"]) > 8  # it decoded on after the short one ended
    _same(results["short"], backend.sample_many([short])[0])


def _at_first_host_check(monkeypatch: pytest.MonkeyPatch, queue_more: object) -> None:
    """Run ``queue_more()`` once, on the worker, at the running engine call's first host check: what
    it queues is there while that call still decodes, however fast the machine."""
    real = sample_joins.SampleJoins.waiting
    pending = [queue_more]

    def waiting(self: sample_joins.SampleJoins) -> bool:
        while pending:
            pending.pop()()  # type: ignore[operator]
        return real(self)

    monkeypatch.setattr(sample_joins.SampleJoins, "waiting", waiting)


def test_parts_queued_during_an_engine_call_join_it(
    backend: TinkerBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows freed in a running call take sample parts queued after it started (one engine call for
    all), each answered as its samples end, each exactly what it samples alone."""
    long = SampleRequest("a", TEXT[:4], 2, SamplingSpec(temperature=1.0, max_new_tokens=160), seed=1)
    late = [SampleRequest("b", TEXT[:5], 2, SPEC, seed=4), SampleRequest(None, TEXT[3:6], 1, SPEC, seed=2)]
    alone = [backend.sample_many([r])[0] for r in [long, *late]]
    queue = BatchingQueue(backend, window_s=0.0)
    futures, finished = [], []

    def queue_late() -> None:
        for i, r in enumerate(late):
            futures.append(queue.submit_calls((f"t-late{i}", "s"), [SamplePart(r)]))
            futures[-1].add_done_callback(lambda _, i=i: finished.append(f"late{i}"))

    _at_first_host_check(monkeypatch, queue_late)
    try:
        first = queue.submit_calls(("t-long", "s"), [SamplePart(long)])
        first.add_done_callback(lambda _: finished.append("long"))
        _same(first.result(timeout=120), alone[0])
        for future, expected in zip(futures, alone[1:], strict=True):
            _same(future.result(timeout=120), expected)
    finally:
        queue.close()
    assert queue.sample_batches == [3]  # one engine call: the late parts joined it
    assert finished[-1] == "long"  # they were answered while it still decoded


def test_joining_stops_when_other_work_waits_and_keeps_the_token_bound(
    backend: TinkerBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward/backward queued while sample parts keep joining a call ends the joining: the call
    drains and the forward/backward runs before the rest of the parts; an engine call never holds
    more than sample_batch_tokens of parts at once."""
    part = 2 * SPEC.max_new_tokens
    queue = BatchingQueue(backend, window_s=0.0, sample_batch_tokens=2 * part)
    datum = Datum(TEXT[:-1], {"target_tokens": TEXT[1:], "weights": [0.0] * (len(TEXT) - 1)})
    order: list[str] = []
    train: list = []

    def queue_train() -> None:
        train.append(queue.submit_forward_backward(ForwardBackwardRequest("c", [datum]), lane=("t-fb", "s")))
        train[0].add_done_callback(lambda _: order.append("fb"))

    _at_first_host_check(monkeypatch, queue_train)
    peak = backend.rank.engine.stats
    peak["peak_rows"] = 0
    try:
        big = queue.submit_calls(
            ("t-big", "s"),
            [SamplePart(SampleRequest("a", TEXT[:4], 2, SPEC, seed=2 * i)) for i in range(8)],
            combine=lambda parts: [r for p in parts for r in p],
            costs=[part] * 8,
        )
        big.add_done_callback(lambda _: order.append("big"))
        assert len(big.result(timeout=120)) == 16
        train[0].result(timeout=120)
    finally:
        queue.close()
    assert order == ["fb", "big"]
    assert len(queue.sample_batches) >= 2  # the call that drained, then the rest
    assert peak["peak_rows"] <= 4  # two parts of two samples at once


def test_a_join_never_moves_a_model_whose_rows_decode(
    backend: TinkerBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every slot has rows in flight: a part of a parked model does not join (it would need one of
    their slots); it runs in the next call, and the running samples are what they are alone."""
    running = [SampleRequest(m, TEXT[:4], 2, SPEC, seed=3) for m in "abc"]
    backend.create_model("d", rank=4, seed=9)  # a fourth model in three slots: one is parked
    try:
        alone = [backend.sample_many([r])[0] for r in running]  # a, b, c resident; d parked
        assert "d" in backend.residency.parked
        queue = BatchingQueue(backend, window_s=0.0)
        late: list = []
        _at_first_host_check(
            monkeypatch,
            lambda: late.append(
                queue.submit_calls(("t-d", "s"), [SamplePart(SampleRequest("d", TEXT[:4], 1, SPEC))])
            ),
        )
        try:
            _sampled_together(queue, running, alone)
            assert len(late[0].result(timeout=120)) == 1
        finally:
            queue.close()
        assert queue.sample_batches == [3, 1]
    finally:
        backend.unload_model("d")


SHORT = SamplingSpec(temperature=1.0, max_new_tokens=4)
POISONED = SamplingSpec(temperature=1.0, top_k=10**30, max_new_tokens=4)  # past params.sampling


def test_a_value_past_the_request_checks_fails_only_its_own_request(backend: TinkerBackend) -> None:
    """``top_k = 10**30`` once overflowed the engine call it shared with other tenants' samples
    (``Overflow when unpacking long long``): now it fails its own request, naming the field, and
    the other tenant's samples are what they are alone."""
    good = SampleRequest("a", TEXT[:5], 2, SHORT, seed=1)
    alone = backend.sample_many([good])[0]
    queue = BatchingQueue(backend, window_s=0.0)
    try:
        gate = _held(queue)
        ok = queue.submit_calls(("t-good", "s"), [SamplePart(good)])
        bad = queue.submit_calls(("t-bad", "s"), [SamplePart(SampleRequest("b", TEXT[:5], 2, POISONED))])
        gate.set()
        _same(ok.result(timeout=120), alone)
        with pytest.raises(TinkerError) as info:
            bad.result(timeout=120)
        assert info.value.key == "sampling_params.top_k" and "-1 (off)" in info.value.message
    finally:
        queue.close()
    assert queue.sample_batches == [2]  # one engine call for both


@pytest.mark.parametrize("streaming", [False, True])
def test_a_poisoned_engine_call_is_split_and_only_the_offender_fails(
    backend: TinkerBackend, streaming: bool
) -> None:
    """Groups handed to the engine past every per-request check: the call is retried without the
    group that fails it, which alone gets the error; when every group fails the error is raised."""
    rank = backend.rank
    good = [GenerationRequest.for_base(TEXT[:5], SHORT, seed=j) for j in range(2)]
    other = [GenerationRequest.for_base(TEXT[2:8], SHORT, seed=5)]
    poisoned = [GenerationRequest.for_base(TEXT[:4], POISONED, seed=3)]
    alone = [rank.sample([good])[0], rank.sample([other])[0]]
    heard: dict[int, object] = {}
    on_group = (lambda i, outcome: heard.__setitem__(i, outcome)) if streaming else None
    outcomes = rank.sample([good, poisoned, other], on_group=on_group)
    assert isinstance(outcomes[1], RolloutError) and "sampling.top_k" in str(outcomes[1])
    _same(outcomes[0], alone[0])
    _same(outcomes[2], alone[1])
    if streaming:
        assert heard == dict(enumerate(outcomes))
    with pytest.raises(RolloutError, match="sampling.top_k"):  # nothing succeeded: the call's error
        rank.sample([poisoned, poisoned], on_group=on_group)
    _same(rank.sample([other])[0], alone[1])  # the engine serves on


def test_top_k_and_stop_ids_beyond_the_models_vocabulary_are_refused(backend: TinkerBackend) -> None:
    vocab = backend.rank.vocab_size
    backend.check_sample(TEXT[:3], SamplingSpec(top_k=vocab, stop_token_ids=[vocab - 1]))
    for spec, key in (
        (SamplingSpec(top_k=vocab + 1), "sampling_params.top_k"),
        (SamplingSpec(stop_token_ids=[vocab]), "sampling_params.stop"),
    ):
        with pytest.raises(TinkerError, match=f"{vocab}") as info:
            backend.check_sample(TEXT[:3], spec)
        assert info.value.key == key


def test_a_prefill_that_fails_gives_every_kv_page_back(backend: TinkerBackend) -> None:
    """A request queued past the engine's checks (straight into its stream) fails its prefill: the
    stream is forgotten and every KV page is free again, so the next call is served as before."""
    engine = backend.rank.engine
    good = [GenerationRequest.for_base(TEXT[:5], SHORT, seed=1)]
    alone = engine.generate(good)
    engine._stream.submit([GenerationRequest.for_base(TEXT[:4], POISONED, seed=3)])  # no check_request
    with pytest.raises(ValueError, match="Overflow"):
        engine.run()
    assert engine._cache.free_pages == engine._cache.num_pages - 1  # all but the null page
    _same(engine.generate(good), alone)
