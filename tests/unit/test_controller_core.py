"""ControllerCore: registration, state machine, slot allocation, step accounting (no Ray, no HTTP)."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time

import pytest

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.controller import (
    AdapterConflictError,
    AdapterState,
    ControllerCore,
    ControllerError,
    IllegalTransitionError,
    UnknownAdapterError,
)
from miles_multilora.controller.admission import DEFAULT_RESOURCE_VALIDATOR, AdmissionRules
from miles_multilora.controller.snapshot import AdapterResult, StepReport
from miles_multilora.controller.states import FINISHED_STATES, check_transition
from miles_multilora.errors import ConfigError, SpecError


def spec(name: str, **overrides) -> dict:
    return {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 5, **overrides}


def state_of(core: ControllerCore, name: str) -> str:
    return core.get(name)["state"]


def running_core(num_slots: int = 2, names: tuple[str, ...] = ("a", "b")) -> ControllerCore:
    core = ControllerCore(num_slots=num_slots, max_rank=16)
    for name in names:
        core.register(spec(name))
    core.snapshot()
    return core


def test_register_queues_pending_and_snapshot_grants_slots_fifo():
    core = ControllerCore(num_slots=2, max_rank=16)
    for name in ("first", "second", "third"):
        record = core.register(spec(name))
        assert record["state"] == "PENDING" and record["slot"] is None
    snap = core.snapshot()
    assert [(a.name, a.slot, a.needs_init, a.step) for a in snap.running] == [
        ("first", 0, True, 0),
        ("second", 1, True, 0),
    ]
    assert snap.draining == () and snap.slots_to_clear == ()
    assert state_of(core, "third") == "PENDING"
    assert core.health()["adapters"]["PENDING"] == 1 and core.health()["slots"]["OWNED"] == 2


def test_snapshot_is_immutable_picklable_and_ids_increase():
    core = running_core()
    snap1, snap2 = core.snapshot(), core.snapshot()
    assert snap2.snapshot_id == snap1.snapshot_id + 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap1.running = ()  # type: ignore[misc]
    clone = pickle.loads(pickle.dumps(snap2))
    assert clone == snap2 and {a.name: a.slot for a in clone.adapters} == {"a": 0, "b": 1}
    snap2.running[0].spec.rank = 2  # the trainer mutating its copy never reaches the controller
    assert core.get("a")["rank"] == 8 and core.snapshot().running[0].spec.rank == 8


def test_cancel_pending_is_immediate_and_running_drains_until_drained():
    core = running_core(num_slots=1, names=("run", "wait"))
    assert core.cancel("wait")["state"] == "CANCELLED"
    assert core.get("wait")["finished_at"] is not None
    assert core.cancel("run")["state"] == "DRAINING"
    assert core.cancel("run")["state"] == "DRAINING"  # idempotent while draining
    snap = core.snapshot()
    assert snap.running == () and [a.name for a in snap.draining] == ["run"]
    core.report_step({"run": AdapterResult(trained=True, step=1)})  # in-flight rollouts may still train
    record = core.drained("run", checkpoint="/ckpt/run/final")
    assert record["state"] == "CANCELLED" and record["last_checkpoint"] == "/ckpt/run/final"
    assert record["checkpoint_step"] == 1 and record["slot"] is None
    assert core.snapshot().slots_to_clear == (0,)


def test_done_and_failed_free_the_slot_as_dirty():
    core = running_core()
    assert core.mark_done("a", checkpoint="/ckpt/a/final")["state"] == "DONE"
    failed = core.mark_failed("b", "reward raised 3 times")
    assert failed["state"] == "FAILED" and failed["reason"] == "reward raised 3 times"
    snap = core.snapshot()
    assert snap.adapters == () and snap.slots_to_clear == (0, 1)


def test_draining_adapter_may_finish_its_budget_or_fail_and_pending_may_fail():
    core = running_core(num_slots=2, names=("a", "b", "c"))
    core.cancel("a")
    core.cancel("b")
    assert core.mark_done("a")["state"] == "DONE"
    assert core.mark_failed("b", "checkpoint write failed")["state"] == "FAILED"
    assert core.mark_failed("c", "dataset vanished")["state"] == "FAILED"
    assert core.snapshot().slots_to_clear == (0, 1)


@pytest.mark.parametrize("finished", sorted(FINISHED_STATES))
def test_finished_states_are_terminal(finished):
    for target in AdapterState:
        with pytest.raises(IllegalTransitionError, match=f"from {finished.value} to {target.value}"):
            check_transition("x", finished, target)


@pytest.mark.parametrize(
    "action",
    [
        lambda c: c.mark_done("p"),  # PENDING -> DONE
        lambda c: c.drained("p"),  # PENDING is not draining
        lambda c: c.drained("a"),  # RUNNING is not draining
        lambda c: c.cancel("done"),  # finished
        lambda c: c.mark_failed("done", "x"),  # finished
        lambda c: c.mark_done("done"),  # finished twice
        lambda c: c.slot_cleared(0),  # slot 0 is owned by "a"
        lambda c: c.report_step({"p": AdapterResult(trained=True)}),  # PENDING adapters do not train
    ],
)
def test_illegal_transitions_raise_and_change_nothing(action):
    core = ControllerCore(num_slots=2, max_rank=16)
    for name in ("a", "done", "p"):
        core.register(spec(name))
    core.snapshot()  # a -> slot 0, done -> slot 1, p waits
    core.mark_done("done")
    before = core.list(all_runs=True), core.health()
    with pytest.raises(IllegalTransitionError):
        action(core)
    assert (core.list(all_runs=True), core.health()) == before


def test_unknown_names_and_slots():
    core = running_core()
    for action in (lambda: core.get("nope"), lambda: core.cancel("nope"), lambda: core.mark_done("nope")):
        with pytest.raises(UnknownAdapterError, match="nope"):
            action()
    with pytest.raises(UnknownAdapterError):
        core.report_step({"a": AdapterResult(trained=True), "nope": AdapterResult(trained=True)})
    assert core.get("a")["step"] == 0  # the valid entry of a rejected report was not applied
    with pytest.raises(ControllerError, match="does not exist"):
        core.slot_cleared(7)


def test_slot_is_reused_only_after_the_trainer_cleared_it():
    core = running_core(num_slots=1, names=("old", "new"))
    core.report_step({"old": AdapterResult(trained=True)})
    core.mark_done("old")
    snap = core.snapshot()
    assert snap.running == () and snap.slots_to_clear == (0,)
    assert state_of(core, "new") == "PENDING"
    assert core.snapshot().slots_to_clear == (0,)  # still dirty until reported cleared
    core.slot_cleared(0)
    core.slot_cleared(0)  # clearing a free slot again is harmless
    snap = core.snapshot()
    (assignment,) = snap.running
    assert (assignment.name, assignment.slot, assignment.needs_init, assignment.step) == ("new", 0, True, 0)
    assert assignment.resume_checkpoint is None and snap.slots_to_clear == ()


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (spec("a/b"), "name"),
        (spec("big", rank=32), "rank"),
        ({"name": "nodata", "num_steps": 3}, "dataset"),
        (spec("typo", learning_rate=1.0), "learning_rate"),
        ("name: [unclosed", "<spec>"),
        (spec("."), "name"),
        (spec("..."), "name"),
        (spec("-x"), "name"),
        (spec(".hidden"), "name"),
        (spec("___"), "name"),
        (spec("inf_lr", optimizer={"lr": float("inf")}), "optimizer.lr"),
        (spec("nan_alpha", alpha=float("nan")), "alpha"),
        (spec("inf_temp", sampling={"temperature": float("inf")}), "sampling.temperature"),
        (spec("inf_timeout", reward={"timeout_s": float("inf")}), "reward.timeout_s"),
        (spec("huge_lr", optimizer={"lr": 5.0}), "optimizer.lr"),
        (spec("topk0", sampling={"top_k": 0}), "sampling.top_k"),
        (spec("topk_neg", sampling={"top_k": -5}), "sampling.top_k"),
        (spec("many", n_samples_per_prompt=10**7), "n_samples_per_prompt"),
        (spec("stop_empty", sampling={"stop": [""]}), "sampling.stop[0]"),
        (spec("kwargs", reward={"kwargs": {"table": list(range(200_000))}}), "<spec>"),
        (spec("kwargs2", reward={"kwargs": {"table": list(range(5_000))}}), "reward.kwargs"),
        ("a: &x [1, 2]\nb: *x\nname: alias\n", "<spec>"),
    ],
)
def test_invalid_specs_raise_spec_error_and_change_nothing(bad, field):
    core = running_core(num_slots=1, names=("a", "b"))
    before = core.list(all_runs=True), core.health()
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        core.register(bad)
    assert field in info.value.key
    assert time.perf_counter() - start < 2.0  # oversized specs are refused before the schema walks them
    assert (core.list(all_runs=True), core.health()) == before


def test_too_many_live_adapters_are_refused():
    core = ControllerCore(num_slots=1, max_rank=16, rules=AdmissionRules(max_live_adapters=2))
    core.register(spec("a"))
    core.register(spec("b"))
    with pytest.raises(AdapterConflictError, match="limit is 2"):
        core.register(spec("c"))
    core.cancel("b")  # PENDING -> CANCELLED frees a place
    core.register(spec("c"))


def test_one_tenant_cannot_fill_the_pool_of_live_adapters():
    rules = AdmissionRules(max_live_adapters=4, max_live_adapters_per_tenant=2)
    core = ControllerCore(num_slots=1, max_rank=16, rules=rules)
    core.register(spec("a1", tenant="team"))
    core.register(spec("a2", tenant="team"))
    before = core.list(all_runs=True)
    with pytest.raises(AdapterConflictError, match="controller.max_live_adapters_per_tenant") as info:
        core.register(spec("a3", tenant="team"))
    assert "'team' already has 2 adapters" in str(info.value) and core.list(all_runs=True) == before
    core.register(spec("b1", tenant="other"))  # the pool has room for the other tenants
    core.register(spec("c1"))  # its own tenant
    core.cancel("a1")  # PENDING -> CANCELLED: room in its tenant's share
    core.register(spec("a3", tenant="team"))
    with pytest.raises(AdapterConflictError, match="controller.max_live_adapters\\)"):
        core.register(spec("d1"))  # the pool itself is full


def test_resource_validator_runs_on_the_parsed_spec_and_its_error_changes_nothing():
    seen: list[AdapterSpec] = []

    def validate(s: AdapterSpec) -> None:
        seen.append(s)
        if s.dataset.task != "basic_arithmetic":
            raise SpecError("dataset.task", f"unknown reasoning-gym task {s.dataset.task!r}")

    core = ControllerCore(num_slots=1, max_rank=16, validate_resources=validate)
    core.register(spec("ok"))
    before = core.list(all_runs=True)
    with pytest.raises(SpecError, match="unknown reasoning-gym task"):
        core.register(spec("bad", dataset={"task": "no_such_task"}))
    assert core.list(all_runs=True) == before
    assert [s.name for s in seen] == ["ok", "bad"] and isinstance(seen[0], AdapterSpec)


def test_project_resource_validator_by_import_path():
    core = ControllerCore(num_slots=1, max_rank=16, validate_resources=DEFAULT_RESOURCE_VALIDATOR)
    core.register(spec("known_task"))
    before = core.list(all_runs=True)
    with pytest.raises(SpecError) as info:
        core.register(spec("unknown_task", dataset={"task": "no_such_reasoning_gym_task"}))
    assert info.value.key == "dataset.task"
    assert core.list(all_runs=True) == before
    for bad in ("no_colon_here", "miles_multilora.nowhere:f", "miles_multilora.errors:MISSING"):
        with pytest.raises(ConfigError, match="validate_resources"):
            ControllerCore(num_slots=1, max_rank=16, validate_resources=bad)


def test_live_duplicate_conflicts_but_finished_name_registers_again():
    core = running_core(num_slots=1, names=("a",))
    before = core.list(all_runs=True)
    with pytest.raises(AdapterConflictError, match="already RUNNING"):
        core.register(spec("a"))
    assert core.list(all_runs=True) == before
    first_run = core.get("a")["run_id"]
    core.mark_done("a", "/ckpt/a")
    again = core.register(spec("a", num_steps=9))
    assert again["state"] == "PENDING" and again["run_id"] != first_run and again["num_steps"] == 9
    assert [r["name"] for r in core.list()] == ["a"]
    runs = core.list(all_runs=True)
    assert [(r["run_id"], r["state"]) for r in runs] == [(first_run, "DONE"), (again["run_id"], "PENDING")]


def test_counters_advance_only_for_adapters_that_trained():
    core = running_core(num_slots=2, names=("a", "b"))
    core.report_step(
        {"a": AdapterResult(trained=True, step=1, metrics={"reward": 0.5}), "b": AdapterResult(trained=False)}
    )
    core.report_step(
        {"a": AdapterResult(trained=True, step=2, checkpoint="/ckpt/a/2"), "b": AdapterResult(trained=False)}
    )
    a, b = core.get("a"), core.get("b")
    assert (a["step"], b["step"]) == (2, 0)
    assert (a["last_checkpoint"], a["checkpoint_step"]) == ("/ckpt/a/2", 2)
    assert [m["reward"] for m in a["metrics"]] == [0.5] and a["metrics"][0]["step"] == 1
    snap = core.snapshot()
    assert [(x.name, x.step, x.needs_init) for x in snap.running] == [("a", 2, False), ("b", 0, False)]


def test_step_mismatch_or_bad_result_is_rejected_without_partial_updates():
    core = running_core()
    before = core.list()
    with pytest.raises(ControllerError, match="disagree"):
        core.report_step(
            {"a": AdapterResult(trained=True, step=1), "b": AdapterResult(trained=False, step=1)}
        )
    with pytest.raises(ControllerError, match="trained"):
        core.report_step({"a": AdapterResult(trained=True), "b": AdapterResult(trained=0)})  # type: ignore[arg-type]
    with pytest.raises(ControllerError, match="metrics"):
        core.report_step({"a": AdapterResult(trained=True, metrics=[1.0])})
    assert core.list() == before
    assert all(a.needs_init for a in core.snapshot().running)


def test_metrics_are_json_safe_and_history_is_bounded():
    core = running_core(num_slots=1, names=("a",))
    for step in range(1, 26):
        core.report_step(
            {"a": AdapterResult(trained=True, metrics={"loss": float("nan"), "n": step, "ok": True})}
        )
    metrics = core.get("a")["metrics"]
    assert len(metrics) == 20 and metrics[-1]["n"] == 25 and metrics[0]["n"] == 6
    assert metrics[-1]["loss"] == "nan" and metrics[-1]["ok"] is True


def test_bad_constructor_arguments_name_the_key():
    with pytest.raises(ConfigError, match="num_slots"):
        ControllerCore(num_slots=0, max_rank=8)
    with pytest.raises(ConfigError, match="max_rank"):
        ControllerCore(num_slots=1, max_rank=0)


def test_concurrent_registrations_and_snapshots_never_share_a_slot():
    core = ControllerCore(num_slots=4, max_rank=16)
    errors: list[BaseException] = []

    def register_many(prefix: str) -> None:
        try:
            for i in range(6):
                core.register(spec(f"{prefix}{i}"))
                core.snapshot()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=register_many, args=(p,)) for p in "wxyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    snap = core.snapshot()
    slots = [a.slot for a in snap.running]
    assert len(core.list()) == 24 and sorted(slots) == [0, 1, 2, 3]
    assert sum(r["state"] == "PENDING" for r in core.list()) == 20
    assert {r["state"] for r in core.list()} == {AdapterState.PENDING.value, AdapterState.RUNNING.value}


def test_one_step_report_clears_steps_finishes_and_fails_in_one_call():
    core = running_core(num_slots=3, names=("done", "failed", "drain"))
    core.cancel("drain")
    core.register(spec("next"))
    report = StepReport(
        snapshot_id=core.snapshot().snapshot_id,
        results={"done": AdapterResult(trained=True, step=1), "failed": AdapterResult(trained=True, step=1)},
        finished={"done": "/ckpt/done/final"},
        failed={"failed": "reward raised 3 times", "done": "ignored: it finished"},
        drained={"drain": "/ckpt/drain/final"},
        cleared=(),
        timing={},
    )
    queue = core.apply_report(report)
    assert set(queue) == {"done", "failed"} and "queue/pending_s" in queue["done"]
    assert [state_of(core, n) for n in ("done", "failed", "drain", "next")] == [
        "DONE", "FAILED", "CANCELLED", "PENDING"
    ]  # fmt: skip
    assert core.get("done")["last_checkpoint"] == "/ckpt/done/final" and core.get("done")["step"] == 1
    assert core.snapshot().slots_to_clear == (0, 1, 2)
    core.apply_report(
        dataclasses.replace(report, results={}, finished={}, failed={}, drained={}, cleared=(0, 2))
    )
    assert [(a.name, a.slot) for a in core.snapshot().running] == [("next", 0)]
