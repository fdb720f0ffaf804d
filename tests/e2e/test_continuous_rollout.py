"""Continuous rollout on the tiny model, in process: every drawn prompt trains exactly once and in
order, no trained token is older than ``rollout.max_staleness`` versions (and some are: the engine
really carried work across steps), adapters step at their own pace, a checkpoint lists the prompts
in flight and a resume draws them again first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_multilora.controller.snapshot import Snapshot
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from tests.e2e.conftest import snapshot_of, tiny_run_config, toy_adapter

STEPS = 4


def _specs() -> list[dict[str, Any]]:
    return [
        toy_adapter("lower", "fraction_of_lowercase", steps=STEPS),
        toy_adapter("letter_a", "fraction_of_letter_a", steps=STEPS, sampling={"max_new_tokens": 20}),
        toy_adapter("digits", "fraction_of_digits", steps=STEPS, batched=True),
    ]


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[RLStep]:
    cfg = tiny_run_config(tmp_path / "run", _specs(), rollout={"max_staleness": 1, "max_batch_size": 8})
    made = RLStep.build(cfg)
    yield made
    compat.destroy_distributed()


def record_trained(worker: RLStep) -> list[tuple[str, int, str, list[int]]]:
    """Every group the step trains: (adapter, its version then, prompt uid, token versions)."""
    seen: list[tuple[str, int, str, list[int]]] = []
    assert worker.continuous is not None
    collect = worker.continuous.collect

    def recording(names: list[str]) -> Any:
        groups = collect(names)
        for g in groups:
            versions = [v for r in g.results for v in r.versions()]
            seen.append((g.adapter, worker.version(g.adapter), g.item.uid, versions))
        return groups

    worker.continuous.collect = recording  # type: ignore[method-assign]
    return seen


def _run(worker: RLStep, specs: list[dict[str, Any]], first: Snapshot | None = None) -> list[Any]:
    outs, i = [], 0
    while i < 6 * STEPS and any(
        worker.residents.get(s["name"]) is None or worker.version(s["name"]) < STEPS for s in specs
    ):
        snap = (
            first
            if (first is not None and i == 0)
            else snapshot_of(i + 1, specs, worker.versions(), init=i == 0)
        )
        out = worker.step(snap)
        assert not out.failed, out.failed
        outs.append(out)
        i += 1
    return outs


def test_every_prompt_trains_once_in_order_within_the_staleness_bound(worker: RLStep) -> None:
    specs = _specs()
    seen = record_trained(worker)
    outs = _run(worker, specs)
    assert all(worker.version(s["name"]) == STEPS for s in specs)
    for s in specs:
        name = s["name"]
        uids = [uid for a, _, uid, _ in seen if a == name]
        assert len(uids) == len(set(uids)) == STEPS * 2  # none lost, none twice
        offsets = [int(u.rsplit(":", 1)[1]) for u in uids]
        assert offsets == list(range(STEPS * 2))  # in draw order
    ages = [version - v for _, version, _, versions in seen for v in versions]
    assert max(ages) == 1 and min(ages) == 0  # within max_staleness, and work was carried over
    staleness = [o.results[n].metrics.get("staleness_max") for o in outs for n in o.results]
    assert max(x for x in staleness if x is not None) == 1
    for s in specs:  # the on-policy drift counts exactly the tokens the trained version sampled
        name = s["name"]
        logged = [o.results[name].metrics for o in outs if name in o.results]
        fresh = [v == version for a, version, _, versions in seen if a == name for v in versions]
        assert sum(m.get("on_policy_tokens", 0.0) for m in logged) == sum(fresh) > 0
        assert sum(m.get("num_tokens", 0.0) for m in logged) == len(fresh)
    assert worker.rank.engine.in_flight() == 0  # nothing drawn beyond the budget is left decoding


def test_a_slow_adapter_does_not_hold_fast_ones_back(tmp_path: Path) -> None:
    specs = [
        toy_adapter("fast", "fraction_of_lowercase", steps=STEPS, sampling={"max_new_tokens": 2}),
        toy_adapter("slow", "fraction_of_letter_a", steps=STEPS, sampling={"max_new_tokens": 48}),
    ]
    cfg = tiny_run_config(tmp_path / "pace", specs, rollout={"max_staleness": 1, "max_batch_size": 8})
    worker = RLStep.build(cfg)
    try:
        outs = _run(worker, specs)
    finally:
        compat.destroy_distributed()
    stepped = [sorted(o.results) for o in outs]
    assert ["fast"] in stepped, stepped  # the fast adapter stepped alone while the slow one decoded
    first_done = {
        n: next(i for i, o in enumerate(outs) if n in o.results and o.results[n].step == STEPS)
        for n in ("fast", "slow")
    }
    assert first_done["fast"] < first_done["slow"]


def test_a_checkpoint_lists_prompts_in_flight_and_a_resume_draws_them_first(
    worker: RLStep, tmp_path: Path
) -> None:
    specs = _specs()
    for i in range(2):
        worker.step(snapshot_of(i + 1, specs, worker.versions(), init=i == 0))
    assert worker.continuous is not None
    in_flight = [it.uid for it in worker.continuous.carried_items("lower")]
    assert in_flight  # max_staleness=1: the next step's prompts are drawn already
    path = worker.save_checkpoint("lower")
    version = worker.version("lower")
    compat.destroy_distributed()

    resumed = RLStep.build(
        tiny_run_config(tmp_path / "run", specs[:1], rollout={"max_staleness": 1, "max_batch_size": 8})
    )
    seen = record_trained(resumed)
    snap = snapshot_of(1, specs[:1], {"lower": version})
    a = snap.running[0]
    snap = Snapshot(1, 1, (type(a)(a.name, a.run_id, a.slot, a.spec, version, path, True),), (), ())
    out = resumed.step(snap)
    assert not out.failed, out.failed
    assert resumed.version("lower") == version + 1
    trained = [uid for _, _, uid, _ in seen]
    assert trained == in_flight[: len(trained)] and trained  # the in-flight prompts came back first


def test_cancel_and_register_mid_stream(worker: RLStep) -> None:
    specs = _specs()
    for i in range(2):
        assert not worker.step(snapshot_of(i + 1, specs, worker.versions(), init=i == 0)).failed
    engine = worker.rank.engine
    stream = engine._stream

    def queued(name: str) -> int:  # requests of ``name`` waiting, decoding or preempted
        rows = [stream.requests[r.request] for r in stream.rows + stream.preempted]
        waiting = [stream.requests[m] for g in stream.waiting for m in g.members]
        return sum(r.adapter == name for r in rows + waiting)

    assert queued("digits") > 0  # its next step was in flight
    newcomer = toy_adapter("newcomer", "fraction_of_lowercase", steps=2)
    kept = [specs[0], specs[1], newcomer]  # digits leaves, newcomer takes its slot
    before = worker.versions()
    for i in range(2, 8):
        snap = snapshot_of(i + 1, kept, worker.versions(), init=False)
        if "newcomer" not in worker.residents:  # only the newcomer's slot is initialised
            a = snap.running[2]
            fresh = type(a)(a.name, a.run_id, a.slot, a.spec, 0, None, True)
            snap = Snapshot(snap.snapshot_id, snap.num_slots, (*snap.running[:2], fresh), (), ())
        out = worker.step(snap)
        assert not out.failed, out.failed
        assert "digits" not in out.results
        if worker.residents.get("newcomer") and worker.version("newcomer") >= 1:
            break
    assert queued("digits") == 0 and "digits" not in worker.residents  # its carried work was cancelled
    assert worker.version("newcomer") >= 1  # a newcomer trains mid-stream
    assert worker.version("lower") > before["lower"]


def test_a_step_that_does_not_move_the_weights_keeps_the_stream_going(
    worker: RLStep, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that trains nothing for an adapter (no trainable rows, a vetoed update) leaves its
    version where it was: its carried groups take that step's place and it goes on stepping."""
    import miles_multilora.rl.step as rl_step_module

    train, dropped = rl_step_module.train, []

    def drop_lower_once(groups: list[Any], residents: Any, algo: Any) -> Any:
        if not dropped and any(g.adapter == "lower" for g in groups):
            dropped.extend(g.item.uid for g in groups if g.adapter == "lower")
            groups = [g for g in groups if g.adapter != "lower"]
        return train(groups, residents, algo)

    monkeypatch.setattr(rl_step_module, "train", drop_lower_once)
    specs = _specs()
    seen = record_trained(worker)
    _run(worker, specs)
    assert dropped  # the first step of ``lower`` trained nothing
    assert all(worker.version(s["name"]) == STEPS for s in specs)
    uids = [uid for a, _, uid, _ in seen if a == "lower"]
    assert len(uids) == len(set(uids)) == STEPS * 2 + len(dropped)  # the dropped ones were replaced
    ages = [version - v for _, version, _, versions in seen for v in versions]
    assert 0 <= min(ages) and max(ages) <= 1


def test_a_newcomer_slower_than_the_others_is_not_started_again_every_step(tmp_path: Path) -> None:
    """The controller says ``needs_init`` until an adapter reports its first step; with per-adapter
    pace a slow newcomer's first step spans several of the fast adapters' steps, and starting it
    again at each of them (its work in flight thrown away) would keep it from ever stepping."""
    from miles_multilora.controller import ControllerCore
    from tests.unit.test_rl_step import drive

    fast = {"sampling": {"max_new_tokens": 2}}
    specs = [toy_adapter(n, "fraction_of_letter_a", steps=1000, **fast) for n in ("f1", "f2")]
    cfg = tiny_run_config(tmp_path / "run", specs, lora={"num_slots": 4, "max_rank": 8},
                          rollout={"max_staleness": 1, "max_batch_size": 64})  # fmt: skip
    core = ControllerCore(num_slots=4, max_rank=8)
    for spec in specs:
        core.register(spec)
    worker = RLStep.build(cfg)
    try:
        for _ in range(3):
            drive(core, [worker])
        core.register(toy_adapter("slow", "fraction_of_lowercase", steps=2, sampling={"max_new_tokens": 24}))
        for _ in range(40):
            drive(core, [worker])
            if core.get("slow")["state"] == "DONE":
                break
        assert core.get("slow")["state"] == "DONE", core.get("slow")
    finally:
        compat.destroy_distributed()
