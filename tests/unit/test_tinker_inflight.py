"""Inflight samplers (``save_weights_and_get_sampling_client(kind="inflight")``) on one in-process
trainer rank (tiny model, CPU): they sample their model's live slot, the newest weights, and every
token records the version that sampled it; another tenant's model or sampler answers like an
unknown one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue
from miles_multilora.tinker.registry import OwnedModel, Sampler
from miles_multilora.tinker.requests import ForwardBackwardRequest, SampleOutput, TinkerError
from miles_multilora.tinker.server import create_app
from miles_multilora.tinker.state import ServerState
from tests.unit.test_tinker_backend import TEXT, sft_datum

SPEC = SamplingSpec(temperature=1.0, max_new_tokens=6)


@pytest.fixture
def state(backend: TinkerBackend, tmp_path: Path) -> Iterator[ServerState]:
    queue = BatchingQueue(backend, window_s=0.0)
    try:
        yield ServerState(
            backend, queue, base_model="tiny", state_dir=tmp_path / "states", settings=TinkerConfig()
        )
    finally:
        queue.close()


def _model(state: ServerState, tenant: str) -> OwnedModel:
    session = state.registry.open_session(tenant)
    model_id = f"{session.session_id}:train:0"
    state.create_model(tenant, session.session_id, model_id, 4, 1, None)
    return state.registry.model(tenant, model_id)


def _step(state: ServerState, owned: OwnedModel) -> None:
    state.backend.forward_backward([ForwardBackwardRequest(owned.model_id, [sft_datum(TEXT)])])
    state.backend.optim_step(owned.model_id, lr=3e-2)


def _sample(state: ServerState, sampler: Sampler, seed: int = 7) -> SampleOutput:
    calls, costs, combine = state.sample_parts(sampler, TEXT[:4], 3, SPEC, seed)
    return state.queue.submit_calls((sampler.tenant, sampler.session_id), calls, combine, costs).result(60)


def test_an_inflight_sampler_samples_the_newest_weights_and_tags_each_token(state: ServerState) -> None:
    owned = _model(state, "t-a")
    _step(state, owned)
    state.save_for_sampler("t-a", owned, None, f"{owned.session_id}:sample:0", inflight=True)
    state.save_for_sampler("t-a", owned, None, f"{owned.session_id}:sample:1")  # a snapshot of version 1
    inflight = state.registry.sampler("t-a", f"{owned.session_id}:sample:0")
    snapshot = state.registry.sampler("t-a", f"{owned.session_id}:sample:1")
    assert inflight.inflight and inflight.version == 1 and inflight.weights is None  # no copy written
    assert list((state.sampler_weights.catalog.root / "t-a").rglob("*.pt")) != []  # the snapshot's only

    _step(state, owned)  # version 2: the inflight sampler follows, the snapshot keeps version 1
    live = state.backend.sample(owned.model_id, TEXT[:4], 3, SPEC, seed=7)
    followed, kept = _sample(state, inflight).sequences, _sample(state, snapshot).sequences
    assert [r.output_ids for r in followed] == [r.output_ids for r in live]
    assert [r.logprobs for r in followed] == [r.logprobs for r in live]  # the live slot's, exactly
    assert [r.logprobs for r in kept] != [r.logprobs for r in live]  # the saved copy's differ
    assert all(v == 2 >= inflight.version for r in followed for v in r.versions())
    assert all(v == 1 for r in kept for v in r.versions())

    state.unload_model(owned)  # an inflight sampler ends with its model's weights
    with pytest.raises(TinkerError, match="inflight sampler"):
        _sample(state, inflight)


def test_an_inflight_sampler_of_another_tenants_model_is_refused_like_an_unknown_one(
    state: ServerState,
) -> None:
    owned = _model(state, "t-a")
    app = create_app(state, authenticate=lambda scope: dict(scope["headers"]).get(b"x-api-key", b"").decode())
    client = TestClient(app)

    def save(tenant: str, model_id: str) -> Any:
        body = {"model_id": model_id, "kind": "inflight", "sampling_session_seq_id": 0, "seq_id": 1}
        return client.post("/api/v1/save_weights_for_sampler", json=body, headers={"x-api-key": tenant})

    theirs, unknown = save("t-b", owned.model_id), save("t-b", owned.model_id[:-1] + "9")
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["detail"].replace(owned.model_id, "<id>") == unknown.json()["detail"].replace(
        owned.model_id[:-1] + "9", "<id>"
    )
    mine = save("t-a", owned.model_id)
    assert mine.status_code == 200, mine.text
    future = client.post(
        "/api/v1/retrieve_future",
        json={"request_id": mine.json()["request_id"]},
        headers={"x-api-key": "t-a"},
    )
    sampler_id = future.json()["sampling_session_id"]
    assert state.registry.sampler("t-a", sampler_id).inflight
    for tenant, status in (("t-b", 404), ("t-a", 200)):
        got = client.get(f"/api/v1/samplers/{sampler_id}", headers={"x-api-key": tenant})
        assert got.status_code == status
    named = client.post(
        "/api/v1/save_weights_for_sampler", headers={"x-api-key": "t-a"},
        json={"model_id": owned.model_id, "kind": "inflight", "path": "p"},
    )  # fmt: skip
    assert named.status_code == 400 and named.json()["field"] == "path"


def _decoding(state: ServerState, model_id: str) -> None:
    """Until the sample call of ``model_id`` has decoded a step (its rows hold a token of the version
    they started with), so work queued next joins between decode steps, not before the first."""
    deadline = time.monotonic() + 60
    while model_id not in state.backend._decoding:
        assert time.monotonic() < deadline, "the sample call never started decoding"
        time.sleep(0.002)
    stats = state.backend.rank.engine.stats
    started = stats["row_steps"]
    while stats["row_steps"] == started:
        assert time.monotonic() < deadline, "the sample call never decoded a step"
        time.sleep(0.002)


@pytest.mark.parametrize("inflight", [True, False])
def test_rows_decoding_move_to_the_stepped_weights_at_the_next_step_only_when_inflight(
    state: ServerState, inflight: bool
) -> None:
    """An ``optim_step`` queued while an inflight sampler's rows decode runs between two decode
    steps: the rows go on (same request, KV kept) and their later tokens carry the new version. A
    snapshot sampler's rows on the live slot hold the step back until they end (one version)."""
    owned = _model(state, "t-a")
    _step(state, owned)
    sampler_id = f"{owned.session_id}:sample:0"
    state.save_for_sampler("t-a", owned, None, sampler_id, inflight=inflight)
    sampler = state.registry.sampler("t-a", sampler_id)
    long = SamplingSpec(temperature=1.0, max_new_tokens=200)
    calls, costs, combine = state.sample_parts(sampler, TEXT[:4], 1, long, 3)
    lane = ("t-a", owned.session_id)
    sampled = state.queue.submit_calls(lane, calls, combine, costs)
    _decoding(state, owned.model_id)
    trained = state.queue.submit_forward_backward(
        ForwardBackwardRequest(owned.model_id, [sft_datum(TEXT)]), lane
    )
    stepped = state.queue.submit_calls(
        lane, [lambda: state.backend.optim_step(owned.model_id, lr=3e-2)], trains=owned.model_id
    )
    (result,) = sampled.result(120).sequences
    trained.result(60), stepped.result(60)
    versions = result.versions()
    assert len(result.output_ids) == 200 and versions == sorted(versions) and versions[0] == 1
    if inflight:
        assert versions[-1] == 2  # moved mid-decode: the step ran before the row ended
    else:
        assert set(versions) == {1}
    assert state.backend.model(owned.model_id).version == 2
