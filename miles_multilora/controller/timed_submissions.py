"""Schedule files: submit and cancel adapters on a running service over time, over its HTTP API.

    events:
      - {at: 0, submit: adapters/a.yaml}               # seconds after the runner starts
      - {at: 20, submit: adapters/b.yaml}
      - {when: {adapter: a, step: 5}, cancel: a}       # once a has trained 5 steps
      - {when: {adapter: b, state: DONE}, submit: adapters/c.yaml}

Each event has a trigger, ``at`` (seconds) and/or ``when`` (``adapter`` plus ``step`` (reached, >=)
and/or ``state`` (one state or a list)); with both, it fires once both hold. Its action is exactly
one of ``submit`` (a spec file, relative to the schedule file) or ``cancel`` (an adapter name).
:func:`load_schedule` validates the whole file first (errors name ``events[i].key``).
:class:`ScheduleRunner` polls the controller, fires ready events in file order, prints a timeline
(elapsed time, event, result, and adapters' state changes) and returns when every event has fired
(or can no longer fire), and with ``wait`` when every adapter it touched has ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.controller.client import ControllerClient
from miles_multilora.controller.errors import ControllerUnavailableError
from miles_multilora.controller.states import AdapterState
from miles_multilora.errors import ConfigError, MilesError, SpecError

EVENT_KEYS = frozenset({"at", "when", "submit", "cancel"})
CONDITION_KEYS = frozenset({"adapter", "step", "state"})
STATE_NAMES = tuple(s.value for s in AdapterState)
FINISHED = frozenset(s.value for s in AdapterState if s.finished)


@dataclass(frozen=True)
class Condition:
    """Holds when ``adapter`` has reached ``step`` (if set) and is in one of ``states`` (if set)."""

    adapter: str
    step: int | None = None
    states: tuple[str, ...] = ()

    def holds(self, record: Mapping[str, Any] | None) -> bool:
        if record is None:
            return False
        if self.step is not None and int(record.get("step") or 0) < self.step:
            return False
        return not self.states or record["state"] in self.states

    def impossible(self, record: Mapping[str, Any] | None) -> bool:
        """The adapter has ended without the condition holding: it never will (for this run)."""
        return record is not None and record["state"] in FINISHED and not self.holds(record)

    def describe(self) -> str:
        parts = [f"step>={self.step}"] if self.step is not None else []
        if self.states:
            parts.append("state in " + "|".join(self.states))
        return f"{self.adapter} {' and '.join(parts)}"


@dataclass(frozen=True)
class ScheduleEvent:
    index: int
    action: str  # "submit" | "cancel"
    adapter: str  # the adapter submitted (its spec's name) or cancelled
    spec_path: Path | None = None
    at: float | None = None
    when: Condition | None = None

    def describe(self) -> str:
        target = f"{self.spec_path.name} ({self.adapter})" if self.spec_path else self.adapter
        trigger = []
        if self.at is not None:
            trigger.append(f"at {self.at:g}s")
        if self.when is not None:
            trigger.append(f"when {self.when.describe()}")
        return f"#{self.index} {self.action} {target} [{', '.join(trigger)}]"


@dataclass
class Schedule:
    events: list[ScheduleEvent]
    path: Path | None = None

    @property
    def adapters(self) -> list[str]:
        """Every adapter the schedule submits or cancels, in first-mention order."""
        return list(dict.fromkeys(e.adapter for e in self.events))


def _err(index: int, key: str, message: str) -> ConfigError:
    return ConfigError(f"events[{index}].{key}", message)


def _parse_condition(index: int, raw: Any) -> Condition:
    if not isinstance(raw, Mapping):
        raise _err(index, "when", f"must be a mapping {{adapter, step, state}}, got {raw!r}")
    unknown = set(raw) - CONDITION_KEYS
    if unknown:
        raise _err(
            index, f"when.{sorted(unknown)[0]}", f"unknown key; use {', '.join(sorted(CONDITION_KEYS))}"
        )
    adapter = raw.get("adapter")
    if not isinstance(adapter, str) or not adapter:
        raise _err(index, "when.adapter", "name the adapter the condition watches")
    step = raw.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise _err(index, "when.step", f"must be an integer >= 0, got {step!r}")
    states_raw = raw.get("state")
    states = [states_raw] if isinstance(states_raw, str) else list(states_raw or [])
    for s in states:
        if s not in STATE_NAMES:
            raise _err(index, "when.state", f"{s!r} is not a state; use one of {', '.join(STATE_NAMES)}")
    if step is None and not states:
        raise _err(index, "when", "give a step and/or a state to wait for")
    return Condition(adapter=adapter, step=step, states=tuple(states))


def _parse_event(index: int, raw: Any, base_dir: Path) -> ScheduleEvent:
    if not isinstance(raw, Mapping):
        raise _err(index, "<event>", f"must be a mapping like {{at: 0, submit: spec.yaml}}, got {raw!r}")
    unknown = set(raw) - EVENT_KEYS
    if unknown:
        raise _err(index, str(sorted(unknown)[0]), f"unknown key; use {', '.join(sorted(EVENT_KEYS))}")
    at = raw.get("at")
    if at is not None and (isinstance(at, bool) or not isinstance(at, int | float) or at < 0):
        raise _err(index, "at", f"must be a number of seconds >= 0, got {at!r}")
    when = _parse_condition(index, raw["when"]) if raw.get("when") is not None else None
    if at is None and when is None:
        raise _err(index, "at", "give a trigger: 'at' (seconds after start) and/or 'when' (a condition)")
    actions = [k for k in ("submit", "cancel") if raw.get(k) is not None]
    if len(actions) != 1:
        raise _err(index, "submit", "give exactly one action: 'submit: SPEC.yaml' or 'cancel: NAME'")
    target = raw[actions[0]]
    if not isinstance(target, str) or not target:
        raise _err(index, actions[0], f"must be a non-empty string, got {target!r}")
    if actions[0] == "cancel":
        return ScheduleEvent(index, "cancel", target, at=None if at is None else float(at), when=when)
    path = Path(target).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise _err(index, "submit", f"spec file {path} not found (paths are relative to the schedule file)")
    try:
        spec = parse_adapter_spec(path)
    except SpecError as exc:
        raise _err(index, f"submit ({path.name}): {exc.key}", exc.message) from exc
    return ScheduleEvent(
        index, "submit", spec.name, spec_path=path, at=None if at is None else float(at), when=when
    )


def parse_schedule(data: Any, base_dir: str | Path = ".", path: Path | None = None) -> Schedule:
    """Validate a schedule mapping ``{events: [...]}``; raises ConfigError naming ``events[i].key``."""
    if not isinstance(data, Mapping) or set(data) != {"events"}:
        raise ConfigError("events", "a schedule is a mapping with one key, 'events': a list of events")
    raw_events = data["events"]
    if not isinstance(raw_events, list) or not raw_events:
        raise ConfigError("events", "must be a non-empty list of events")
    events = [_parse_event(i, raw, Path(base_dir)) for i, raw in enumerate(raw_events)]
    return Schedule(events=events, path=path)


def load_schedule(path: str | Path) -> Schedule:
    """Read and validate a schedule YAML file (spec paths are relative to it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("schedule", f"schedule file {path} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError("schedule", f"{path} is not valid YAML: {exc}") from exc
    return parse_schedule(data, base_dir=path.parent, path=path)


@dataclass
class EventOutcome:
    event: ScheduleEvent
    status: str  # "ok" | "refused" | "skipped"
    detail: str
    elapsed_s: float


@dataclass
class ScheduleResult:
    outcomes: list[EventOutcome] = field(default_factory=list)
    final: dict[str, dict[str, Any]] = field(default_factory=dict)  # adapter -> last seen record
    timed_out: bool = False
    timeline: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(o.status == "ok" for o in self.outcomes)


class ScheduleRunner:
    """Drives a running service through a :class:`Schedule` (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        client: ControllerClient,
        console: Console | None = None,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.schedule = schedule
        self.client = client
        self.console = console or Console()
        self.poll_s = poll_s
        self._clock, self._sleep = clock, sleep
        self._t0 = 0.0
        self._seen: dict[str, tuple[str, str]] = {}  # adapter -> (run_id, state)
        self._tracked: set[str] = set()  # run ids seen live or submitted by this runner
        self._unreachable = False
        self._result = ScheduleResult()

    def _say(self, message: str) -> None:
        line = f"[{self._clock() - self._t0:7.1f}s] {message}"
        self._result.timeline.append(line)
        self.console.print(line, highlight=False, markup=False)

    def _poll(self) -> dict[str, dict[str, Any]] | None:
        """Every adapter's latest record (None while the controller is unreachable)."""
        try:
            records = {r["name"]: r for r in self.client.list()}
        except ControllerUnavailableError as exc:
            if not self._unreachable:
                self._say(f"controller unreachable, retrying: {exc}")
            self._unreachable = True
            return None
        if self._unreachable:
            self._say("controller reachable again")
            self._unreachable = False
        for name, r in records.items():
            if r["state"] not in FINISHED:
                self._tracked.add(r["run_id"])
            key = (r["run_id"], r["state"])
            if self._seen.get(name) != key:
                detail = f" (reason: {r['reason']})" if r.get("reason") else ""
                self._say(f"{name}: {r['state']} at step {r['step']}{detail}")
                self._seen[name] = key
        return records

    def _fire(self, event: ScheduleEvent) -> EventOutcome:
        try:
            if event.action == "submit":
                assert event.spec_path is not None
                record = self.client.submit(event.spec_path)
                self._tracked.add(record["run_id"])
                detail = f"{record['name']} registered as {record['run_id']}: {record['state']}"
            else:
                record = self.client.cancel(event.adapter)
                detail = f"{event.adapter} now {record['state']}"
            status = "ok"
        except ControllerUnavailableError:
            raise
        except ConfigError as exc:
            status, detail = "refused", f"{exc.key}: {exc.message}"
        except MilesError as exc:
            status, detail = "refused", str(exc)
        outcome = EventOutcome(event, status, detail, self._clock() - self._t0)
        self._say(f"{event.describe()} -> {status}: {detail}")
        return outcome

    def _current(self, name: str, records: Mapping[str, dict[str, Any]]) -> dict[str, Any] | None:
        """``name``'s record if its run is one this runner saw live or submitted (not older history)."""
        record = records.get(name)
        return record if record is not None and record["run_id"] in self._tracked else None

    def _ready(self, event: ScheduleEvent, records: Mapping[str, dict[str, Any]]) -> bool:
        if event.at is not None and self._clock() - self._t0 < event.at:
            return False
        return event.when is None or event.when.holds(self._current(event.when.adapter, records))

    def run(self, wait: bool = False, timeout_s: float | None = None) -> ScheduleResult:
        """Fire every event (file order among those ready at once); with ``wait``, also wait
        until every adapter the schedule touched has ended. Stops at ``timeout_s``."""
        self._t0 = self._clock()
        pending = list(self.schedule.events)
        self._say(f"schedule with {len(pending)} events on {self.client.url}")
        records: dict[str, dict[str, Any]] = {}
        while True:
            polled = self._poll()
            if polled is not None:
                records = polled
                for event in list(pending):
                    cond = event.when
                    record = None if cond is None else self._current(cond.adapter, records)
                    if cond is not None and record is not None and cond.impossible(record):
                        detail = f"{cond.adapter} ended {record['state']} at step {record['step']}"
                        self._result.outcomes.append(
                            EventOutcome(event, "skipped", detail, self._clock() - self._t0)
                        )
                        self._say(f"{event.describe()} -> skipped: can no longer fire ({detail})")
                        pending.remove(event)
                    elif self._ready(event, records):
                        try:
                            self._result.outcomes.append(self._fire(event))
                        except ControllerUnavailableError:
                            break  # retried at the next poll
                        pending.remove(event)
                        records = self._poll() or records
            if not pending and (not wait or self._all_ended(records)):
                break
            if timeout_s is not None and self._clock() - self._t0 >= timeout_s:
                self._result.timed_out = True
                self._say(f"timeout after {timeout_s:g}s; {len(pending)} events not fired")
                break
            self._sleep(self.poll_s)
        self._result.final = {n: records[n] for n in self.schedule.adapters if n in records}
        self._say(
            "finished: "
            + (", ".join(f"{n}={r['state']}@{r['step']}" for n, r in self._result.final.items()) or "-")
        )
        return self._result

    def _all_ended(self, records: Mapping[str, dict[str, Any]]) -> bool:
        """Every adapter of the schedule that this runner saw live has ended."""
        current = (self._current(n, records) for n in self.schedule.adapters)
        return all(r["state"] in FINISHED for r in current if r is not None)


def wait_for_controller(client: ControllerClient, timeout_s: float, poll_s: float = 0.5) -> dict[str, Any]:
    """``client.health()`` once the controller answers; ControllerUnavailableError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.health()
        except ControllerUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)


def run_schedule_command(
    schedule_path: str | Path,
    *,
    url: str | None = None,
    token: str | None = None,
    state_dir: str | Path | None = None,
    wait: bool = False,
    timeout_s: float | None = None,
    connect_timeout_s: float = 120.0,
    poll_s: float = 1.0,
    console: Console | None = None,
) -> int:
    """The ``miles-multilora schedule`` subcommand. Exit code: 0 every event fired and succeeded,
    1 the file is invalid or an event was refused/skipped, 2 the controller cannot be reached,
    3 timeout."""
    console = console or Console()
    try:
        schedule = load_schedule(schedule_path)
        deadline = time.monotonic() + connect_timeout_s
        while True:  # the service may still be starting and not have written its endpoint yet
            try:
                client = ControllerClient.from_env(url=url, token=token, state_dir=state_dir)
                wait_for_controller(client, max(0.0, deadline - time.monotonic()))
                break
            except ControllerUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
        result = ScheduleRunner(schedule, client, console=console, poll_s=poll_s).run(
            wait=wait, timeout_s=timeout_s
        )
    except ControllerUnavailableError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    except ConfigError as exc:
        console.print(f"[red]schedule error {escape(exc.key)}: {escape(exc.message)}[/red]", highlight=False)
        return 1
    if result.timed_out:
        return 3
    return 0 if result.ok else 1
