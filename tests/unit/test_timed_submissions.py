"""Schedule files: validation, firing order, conditions, refusals and timeouts against a real
ControllerCore behind the real HTTP server (the trainer's side is played by :func:`_train_one_step`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from miles_multilora.cli import main
from miles_multilora.controller.client import ControllerClient
from miles_multilora.controller.core import ControllerCore
from miles_multilora.controller.http_api import ControllerHTTPServer
from miles_multilora.controller.snapshot import AdapterResult
from miles_multilora.controller.timed_submissions import ScheduleRunner, load_schedule, parse_schedule
from miles_multilora.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def _spec(name: str, num_steps: int = 3, **extra: Any) -> dict[str, Any]:
    return {"name": name, "num_steps": num_steps, "dataset": {"task": "basic_arithmetic"}, **extra}


def _write(
    tmp: Path, events: list[Any], specs: dict[str, dict[str, Any]] | None = None, name: str = "schedule"
) -> Path:
    for adapter, spec in (specs or {}).items():
        (tmp / f"{adapter}.yaml").write_text(yaml.safe_dump(spec))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"events": events}))
    return path


@pytest.fixture()
def service() -> Iterator[tuple[ControllerCore, ControllerClient]]:
    core = ControllerCore(num_slots=2, max_rank=16)
    server = ControllerHTTPServer(core, port=0)
    url = server.start()
    yield core, ControllerClient(url)
    server.stop()


def _train_one_step(core: ControllerCore) -> None:
    """What the trainer does once per step: clear slots, train RUNNING, finish budgets and drains."""
    snap = core.snapshot()
    for slot in snap.slots_to_clear:
        core.slot_cleared(slot)
    for a in snap.draining:
        core.drained(a.name, f"ckpt/{a.name}/{a.step}")
    if snap.running:
        core.report_step({a.name: AdapterResult(trained=True, checkpoint=None) for a in snap.running})
    for a in snap.running:
        if a.step + 1 >= a.spec.num_steps:
            core.mark_done(a.name, f"ckpt/{a.name}/{a.step + 1}")


def _runner(
    core: ControllerCore, client: ControllerClient, schedule: Any, train: bool = True
) -> ScheduleRunner:
    """Each poll interval is one training step (when ``train``), so runs are deterministic."""
    sleep = (lambda s: _train_one_step(core)) if train else (lambda s: None)
    return ScheduleRunner(schedule, client, console=Console(quiet=True), poll_s=0.0, sleep=sleep)


# ------------------------------------------------------------------ parsing and validation


def test_parse_resolves_spec_paths_relative_to_the_schedule_file(tmp_path: Path) -> None:
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "first.yaml").write_text(yaml.safe_dump(_spec("alpha")))
    path = _write(
        tmp_path,
        [
            {"at": 1.5, "submit": "specs/first.yaml"},
            {"when": {"adapter": "alpha", "state": ["DONE", "FAILED"]}, "cancel": "other"},
            {"at": 3, "when": {"adapter": "alpha", "step": 2}, "cancel": "alpha"},
        ],
    )
    schedule = load_schedule(path)
    first, second, third = schedule.events
    assert first.action == "submit" and first.adapter == "alpha" and first.at == 1.5
    assert first.spec_path == tmp_path / "specs" / "first.yaml"
    assert second.at is None and second.when is not None and second.when.states == ("DONE", "FAILED")
    assert third.at == 3.0 and third.when is not None and third.when.step == 2
    assert schedule.adapters == ["alpha", "other"]


@pytest.mark.parametrize(
    ("events", "key"),
    [
        ([], "events"),
        ([{"at": 0, "submit": "a.yaml", "after": 3}], "events[0].after"),
        ([{"submit": "a.yaml"}], "events[0].at"),
        ([{"at": -1, "submit": "a.yaml"}], "events[0].at"),
        ([{"at": 0}], "events[0].submit"),
        ([{"at": 0, "submit": "a.yaml", "cancel": "a"}], "events[0].submit"),
        ([{"at": 0, "submit": "a.yaml"}, {"at": 0, "submit": "missing.yaml"}], "events[1].submit"),
        ([{"at": 0, "cancel": 7}], "events[0].cancel"),
        ([{"when": {"adapter": "a"}, "cancel": "a"}], "events[0].when"),
        ([{"when": {"step": 3}, "cancel": "a"}], "events[0].when.adapter"),
        ([{"when": {"adapter": "a", "step": -2}, "cancel": "a"}], "events[0].when.step"),
        ([{"when": {"adapter": "a", "state": "FINISHED"}, "cancel": "a"}], "events[0].when.state"),
        ([{"when": {"adapter": "a", "steps": 2}, "cancel": "a"}], "events[0].when.steps"),
        ([{"at": 0, "submit": "bad.yaml"}], "events[0].submit (bad.yaml): rank"),
    ],
)
def test_invalid_schedules_name_the_event_and_key(tmp_path: Path, events: list[Any], key: str) -> None:
    path = _write(tmp_path, events, {"a": _spec("a"), "bad": _spec("bad", rank=0)})
    with pytest.raises(ConfigError) as info:
        load_schedule(path)
    assert info.value.key == key


def test_schedule_must_be_a_mapping_of_events(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="events"):
        parse_schedule([{"at": 0, "cancel": "a"}])
    path = tmp_path / "s.yaml"
    path.write_text("events: [at: 0")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_schedule(path)


def test_shipped_example_schedules_are_valid() -> None:
    paths = sorted((REPO_ROOT / "examples" / "multi_lora" / "schedules").glob("*.yaml"))
    assert paths
    for path in paths:
        schedule = load_schedule(path)
        assert all(e.spec_path is None or e.spec_path.is_file() for e in schedule.events)


# ------------------------------------------------------------------ running against a controller


def test_events_fire_in_time_then_file_order(
    tmp_path: Path, service: tuple[ControllerCore, ControllerClient]
) -> None:
    core, client = service
    specs = {n: _spec(n) for n in ("late", "first", "second")}
    path = _write(
        tmp_path,
        [
            {"at": 1.5, "submit": "late.yaml"},
            {"at": 0, "submit": "first.yaml"},
            {"at": 0, "submit": "second.yaml"},
        ],
        specs,
    )
    runner = ScheduleRunner(load_schedule(path), client, console=Console(quiet=True), poll_s=0.02)
    result = runner.run(timeout_s=10)
    assert result.ok
    assert [o.event.adapter for o in result.outcomes] == ["first", "second", "late"]
    assert result.outcomes[2].elapsed_s >= 1.5
    assert [r["name"] for r in core.list()] == ["first", "second", "late"]  # registration order


def test_conditions_cancel_and_chain_submissions(
    tmp_path: Path, service: tuple[ControllerCore, ControllerClient]
) -> None:
    core, client = service
    specs = {"a": _spec("a", 4), "b": _spec("b", 10), "c": _spec("c", 3), "d": _spec("d", 2)}
    path = _write(
        tmp_path,
        [
            {"at": 0, "submit": "a.yaml"},
            {"at": 0, "submit": "b.yaml"},
            {"at": 0, "submit": "c.yaml"},  # 2 slots: waits for one
            {"when": {"adapter": "b", "step": 2}, "cancel": "b"},
            {"when": {"adapter": "a", "state": "DONE"}, "submit": "d.yaml"},
        ],
        specs,
    )
    result = _runner(core, client, load_schedule(path)).run(wait=True, timeout_s=30)
    assert result.ok, result.timeline
    states = {n: (r["state"], r["step"]) for n, r in result.final.items()}
    assert states == {"a": ("DONE", 4), "b": ("CANCELLED", 2), "c": ("DONE", 3), "d": ("DONE", 2)}
    text = "\n".join(result.timeline)
    for line in ("c: PENDING at step 0", "b: DRAINING at step 2", "c: RUNNING", "d: DONE at step 2"):
        assert line in text
    # d was submitted only once a was DONE
    assert text.index("a: DONE") < text.index("submit d.yaml")


def test_impossible_condition_is_skipped_and_a_refusal_is_reported(
    tmp_path: Path, service: tuple[ControllerCore, ControllerClient]
) -> None:
    core, client = service
    path = _write(
        tmp_path,
        [
            {"at": 0, "submit": "a.yaml"},
            {"at": 0, "submit": "a.yaml"},  # a is live: 409
            {"when": {"adapter": "a", "step": 50}, "cancel": "a"},  # a ends at step 2
        ],
        {"a": _spec("a", 2)},
    )
    result = _runner(core, client, load_schedule(path)).run(wait=True, timeout_s=30)
    assert [o.status for o in result.outcomes] == ["ok", "refused", "skipped"]
    assert "already" in result.outcomes[1].detail
    assert not result.ok and not result.timed_out
    assert result.final["a"]["state"] == "DONE"


def test_conditions_ignore_earlier_runs_of_a_name(
    tmp_path: Path, service: tuple[ControllerCore, ControllerClient]
) -> None:
    core, client = service
    client.submit(_spec("a", 2))
    client.cancel("a")  # an earlier, finished run of "a"
    path = _write(
        tmp_path,
        [
            {"when": {"adapter": "a", "state": "CANCELLED"}, "submit": "b.yaml"},
            {"at": 0.2, "submit": "a.yaml"},
        ],
        {"a": _spec("a", 2), "b": _spec("b", 1)},
    )
    result = _runner(core, client, load_schedule(path)).run(wait=True, timeout_s=5)
    # the new run of a ends DONE, so "a CANCELLED" never held for a run this schedule saw
    assert [o.status for o in result.outcomes] == ["ok", "skipped"]
    assert "b" not in result.final


def test_timeout_when_a_condition_never_holds(
    tmp_path: Path, service: tuple[ControllerCore, ControllerClient]
) -> None:
    core, client = service
    path = _write(
        tmp_path,
        [{"at": 0, "submit": "a.yaml"}, {"when": {"adapter": "a", "step": 1}, "cancel": "a"}],
        {"a": _spec("a")},
    )
    runner = ScheduleRunner(load_schedule(path), client, console=Console(quiet=True), poll_s=0.05)
    result = runner.run(timeout_s=0.4)  # no trainer: a never trains
    assert result.timed_out and not result.ok
    assert core.get("a")["state"] == "PENDING"


def test_cli_schedule_exit_codes(tmp_path: Path, service: tuple[ControllerCore, ControllerClient]) -> None:
    core, client = service
    path = _write(tmp_path, [{"at": 0, "submit": "a.yaml"}], {"a": _spec("a")})
    assert main(["schedule", str(path), "--url", client.url, "--poll", "0.05"]) == 0
    assert core.get("a")["state"] == "PENDING"
    assert main(["schedule", str(path), "--url", client.url, "--poll", "0.05"]) == 1  # a is live: refused
    bad = _write(tmp_path, [{"at": 0}], name="bad")
    assert main(["schedule", str(bad), "--url", client.url]) == 1
    assert main(["schedule", str(path), "--url", "http://127.0.0.1:9", "--connect-timeout", "0"]) == 2
    state_dir = tmp_path / "no_service"
    assert main(["schedule", str(path), "--state-dir", str(state_dir), "--connect-timeout", "0"]) == 2
    waiting = _write(tmp_path, [{"when": {"adapter": "a", "step": 5}, "cancel": "a"}], name="waiting")
    assert main(["schedule", str(waiting), "--url", client.url, "--poll", "0.05", "--timeout", "0.3"]) == 3
