"""ControllerCore persistence: atomic state file, restore after a restart, corrupt files."""

from __future__ import annotations

import json
import os

import pytest

from miles_multilora.controller import (
    ControllerCore,
    ControllerStateError,
    IllegalTransitionError,
    UnknownAdapterError,
)
from miles_multilora.controller.history import HISTORY_FILE_NAME
from miles_multilora.controller.persistence import STATE_FILE_NAME
from miles_multilora.controller.snapshot import AdapterResult
from miles_multilora.errors import ConfigError


def spec(name: str, **overrides) -> dict:
    return {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 5, **overrides}


def build_mixed_state(state_dir) -> ControllerCore:
    """slots: run (0), drain (1); queue: wait1, wait2; finished: done, failed."""
    core = ControllerCore(num_slots=2, max_rank=16, state_dir=state_dir)
    for name in ("done", "failed"):
        core.register(spec(name))
    core.snapshot()
    core.report_step(
        {"done": AdapterResult(trained=True, checkpoint="/ck/done/1"), "failed": AdapterResult(trained=False)}
    )
    core.mark_done("done", "/ck/done/final")
    core.mark_failed("failed", "reward timed out")
    for slot in core.snapshot().slots_to_clear:
        core.slot_cleared(slot)
    for name in ("run", "drain", "wait1", "wait2"):
        core.register(spec(name))
    core.snapshot()  # run -> 0, drain -> 1
    for step in (1, 2, 3):
        ckpt = {"checkpoint": f"/ck/run/{step}"} if step == 2 else {}
        core.report_step(
            {"run": AdapterResult(trained=True, **ckpt), "drain": AdapterResult(trained=step == 1)}
        )
    core.report_step({"drain": AdapterResult(trained=False, checkpoint="/ck/drain/1")})
    core.cancel("drain")
    return core


def test_every_change_is_persisted_and_restore_brings_back_the_same_records(tmp_path):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path)
    core.register(spec("a"))
    saved = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    assert [r["name"] for r in saved["runs"]] == ["a"]
    restored = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    assert restored.list() == core.list()


def test_restore_resumes_unfinished_adapters_from_their_last_checkpoint(tmp_path):
    before = {r["name"]: r for r in build_mixed_state(tmp_path).list()}
    assert before["run"]["step"] == 3 and before["drain"]["state"] == "DRAINING"

    core = ControllerCore.restore(tmp_path, num_slots=2, max_rank=16)
    after = {r["name"]: r for r in core.list()}
    for name in ("done", "failed"):  # finished adapters keep their records
        assert after[name] == before[name]
    assert after["failed"]["reason"] == "reward timed out"
    assert after["done"]["last_checkpoint"] == "/ck/done/final"
    assert [after[n]["state"] for n in ("wait1", "wait2")] == ["PENDING", "PENDING"]

    snap = core.snapshot()
    (run,) = snap.running
    (drain,) = snap.draining
    # step goes back to the checkpoint; the slot must be (re)initialised from that checkpoint
    assert (run.name, run.slot, run.step, run.needs_init, run.resume_checkpoint) == (
        "run",
        0,
        2,
        True,
        "/ck/run/2",
    )
    assert (drain.name, drain.slot, drain.step, drain.needs_init) == ("drain", 1, 1, True)
    assert drain.resume_checkpoint == "/ck/drain/1" and snap.slots_to_clear == ()
    assert after["run"]["run_id"] == before["run"]["run_id"]  # resumed, not resubmitted

    core.drained("drain")
    core.slot_cleared(1)
    (run, wait1) = core.snapshot().running  # the queue still moves in FIFO order
    assert (wait1.name, wait1.slot, wait1.resume_checkpoint) == ("wait1", 1, None)


def test_restore_with_fewer_slots_requeues_running_and_ends_draining(tmp_path):
    build_mixed_state(tmp_path)
    core = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    states = {r["name"]: (r["state"], r["slot"]) for r in core.list()}
    assert states["run"] == ("RUNNING", 0)
    assert states["drain"] == ("CANCELLED", None)
    assert core.get("drain")["last_checkpoint"] == "/ck/drain/1"

    build_dir = tmp_path / "second"
    first = ControllerCore(num_slots=2, max_rank=16, state_dir=build_dir)
    first.register(spec("x"))
    first.register(spec("y"))
    first.snapshot()
    first.report_step({"y": AdapterResult(trained=True, checkpoint="/ck/y/1")})
    core = ControllerCore.restore(build_dir, num_slots=1, max_rank=16)
    assert [(r["name"], r["state"]) for r in core.list()] == [("x", "RUNNING"), ("y", "PENDING")]
    core.mark_done("x")
    core.slot_cleared(0)
    (y,) = core.snapshot().running
    assert (y.name, y.needs_init, y.resume_checkpoint, y.step) == ("y", True, "/ck/y/1", 1)


def test_restore_fails_live_adapters_whose_rank_no_longer_fits(tmp_path):
    core = ControllerCore(num_slots=2, max_rank=32, state_dir=tmp_path)
    core.register(spec("small", rank=8))
    core.register(spec("large", rank=32))
    core.snapshot()
    restored = ControllerCore.restore(tmp_path, num_slots=2, max_rank=16)
    assert restored.get("small")["state"] == "RUNNING"
    large = restored.get("large")
    assert large["state"] == "FAILED" and "max_rank" in large["reason"]
    assert [a.name for a in restored.snapshot().running] == ["small"]


def test_idle_snapshots_write_nothing_and_ids_continue_after_a_restart(tmp_path):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path)
    core.register(spec("a"))
    granted = core.snapshot().snapshot_id  # grants the slot: written
    written = (tmp_path / STATE_FILE_NAME).read_bytes()
    mtime = (tmp_path / STATE_FILE_NAME).stat().st_mtime_ns
    ids = [core.snapshot().snapshot_id for _ in range(5)]  # idle: nothing to write
    assert ids == list(range(granted + 1, granted + 6))
    assert (tmp_path / STATE_FILE_NAME).read_bytes() == written
    assert (tmp_path / STATE_FILE_NAME).stat().st_mtime_ns == mtime
    assert ControllerCore.restore(tmp_path, num_slots=1, max_rank=16).snapshot().snapshot_id > granted


def _finish_many(core: ControllerCore, names: list[str]) -> None:
    for name in names:
        core.register(spec(name))
        core.cancel(name)  # PENDING -> CANCELLED at once


def test_finished_runs_move_to_the_history_and_the_state_keeps_live_runs_only(tmp_path):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path)
    _finish_many(core, ["x", "y"])
    core.register(spec("live"))
    saved = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    assert [r["name"] for r in saved["runs"]] == ["live"]
    lines = [json.loads(line) for line in (tmp_path / HISTORY_FILE_NAME).read_text().splitlines()]
    assert [(e["name"], e["state"], e["spec"]["name"]) for e in lines] == [
        ("x", "CANCELLED", "x"),
        ("y", "CANCELLED", "y"),
    ]
    restored = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    assert restored.list() == core.list() and restored.get("x") == core.get("x")
    assert restored.get("x")["spec"]["num_steps"] == 5
    with pytest.raises(IllegalTransitionError, match="already ended CANCELLED"):
        restored.cancel("x")


def test_history_retention_forgets_the_oldest_runs_and_compacts_the_file(tmp_path):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path, history_retention=3)
    _finish_many(core, [f"r{i}" for i in range(8)])
    assert [r["name"] for r in core.list()] == ["r5", "r6", "r7"]
    assert len((tmp_path / HISTORY_FILE_NAME).read_text().splitlines()) <= 6  # compacted at > 2 x 3
    with pytest.raises(UnknownAdapterError):
        core.get("r0")
    restored = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16, history_retention=3)
    assert [r["name"] for r in restored.list(all_runs=True)] == ["r5", "r6", "r7"]


def test_a_crash_between_the_history_and_the_state_write_keeps_the_run_finished(tmp_path, monkeypatch):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path)
    core.register(spec("a"))
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        core.cancel("a")  # history line written, state file not replaced
    monkeypatch.undo()
    assert json.loads((tmp_path / STATE_FILE_NAME).read_text())["runs"][0]["state"] == "PENDING"
    restored = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    assert [(r["name"], r["state"]) for r in restored.list()] == [("a", "CANCELLED")]
    assert restored.snapshot().running == ()


def test_a_state_file_of_the_earlier_format_moves_its_finished_runs_to_the_history(tmp_path):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path)
    core.register(spec("old"))
    core.register(spec("live"))
    state = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    state["runs"][0].update(state="DONE", finished_at=1.0, reason=None)  # as format 1 kept it
    (tmp_path / STATE_FILE_NAME).write_text(json.dumps(state))
    restored = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    assert [(r["name"], r["state"]) for r in restored.list()] == [("old", "DONE"), ("live", "PENDING")]
    assert "old" in (tmp_path / HISTORY_FILE_NAME).read_text()


def test_ten_thousand_finished_runs_restore_and_writes_only_append(tmp_path):
    """Finished runs live in the append-only history: restoring 10k of them works, and each later
    write rewrites only the small state file and appends its own history lines (never the 10k).
    Restore and write times are measured by benchmarks/controller_churn.py, not asserted here."""
    core = ControllerCore(num_slots=2, max_rank=16, state_dir=tmp_path)
    _finish_many(core, ["template"])
    history = tmp_path / HISTORY_FILE_NAME
    template = json.loads(history.read_text())
    with history.open("w") as f:
        for i in range(10_000):
            entry = {**template, "name": f"run{i}", "run_id": f"run{i}-{i + 1}", "seq": i + 1}
            entry["spec"] = {**template["spec"], "name": f"run{i}"}
            f.write(json.dumps(entry) + "\n")
    state = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    (tmp_path / STATE_FILE_NAME).write_text(json.dumps({**state, "seq": 10_000}))

    restored = ControllerCore.restore(tmp_path, num_slots=2, max_rank=16)
    assert len(restored.list()) == 10_000 and restored.health()["adapters"]["CANCELLED"] == 10_000
    before = history.read_bytes()
    for i in range(20):  # each register and cancel writes the state file (and the history line)
        restored.register(spec(f"new{i}"))
        restored.snapshot()
        restored.cancel(f"new{i}")
        state_bytes = (tmp_path / STATE_FILE_NAME).stat().st_size
        assert state_bytes < 10_000, f"the state file grew to {state_bytes} bytes with no live run"
    after = history.read_bytes()
    assert after.startswith(before), "the history was rewritten instead of appended to"
    added = [json.loads(line) for line in after[len(before) :].decode().splitlines()]
    # new0 and new1 took the two slots at their snapshot: cancelling them drains, it does not finish
    assert [e["name"] for e in added] == [f"new{i}" for i in range(2, 20)]


def test_temp_leftovers_are_ignored_and_a_failed_write_changes_nothing(tmp_path, monkeypatch):
    core = ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path)
    core.register(spec("kept"))
    good = (tmp_path / STATE_FILE_NAME).read_bytes()
    (tmp_path / f".{STATE_FILE_NAME}.crash.tmp").write_text('{"format_version": 1, "runs": [')  # half-written

    def crash_before_rename(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash_before_rename)
    listing = core.list()
    with pytest.raises(OSError, match="disk full"):
        core.register(spec("lost"))
    monkeypatch.undo()
    assert core.list() == listing  # memory rolled back to the last saved state
    assert (tmp_path / STATE_FILE_NAME).read_bytes() == good
    restored = ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    assert [r["name"] for r in restored.list()] == ["kept"]
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != STATE_FILE_NAME)
    assert leftovers == [f".{STATE_FILE_NAME}.crash.tmp"]  # the failed write left no temp file


@pytest.mark.parametrize("content", ['{"format_version": 1, "runs": [', "[]", '{"format_version": 99}'])
def test_a_corrupt_state_file_is_never_read_as_empty(tmp_path, content):
    (tmp_path / STATE_FILE_NAME).write_text(content)
    with pytest.raises(ControllerStateError, match=STATE_FILE_NAME):
        ControllerCore.restore(tmp_path, num_slots=1, max_rank=16)
    assert (tmp_path / STATE_FILE_NAME).read_text() == content


def test_fresh_state_dir_and_refusal_to_overwrite_a_saved_state(tmp_path):
    core = ControllerCore.restore(tmp_path / "new", num_slots=1, max_rank=16)
    assert core.list() == [] and (tmp_path / "new" / STATE_FILE_NAME).is_file()
    core.register(spec("a"))
    with pytest.raises(ConfigError, match="state_dir"):
        ControllerCore(num_slots=1, max_rank=16, state_dir=tmp_path / "new")
    assert [r["name"] for r in ControllerCore.restore(tmp_path / "new", 1, 16).list()] == ["a"]
