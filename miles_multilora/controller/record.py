"""One registration of one adapter (a *run*), as the controller keeps and persists it."""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.controller.quotas import tenant_of
from miles_multilora.controller.states import AdapterState

METRICS_HISTORY = 20  # recent per-step metric entries kept per live adapter
FINISHED_METRICS = 1  # entries kept in the run history once an adapter has ended
HISTORY_ONLY_KEYS = ("seq", "remote")  # in history entries, not in public records


def jsonable_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as strict-JSON values: numbers stay numbers, non-finite floats and others become str."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
            value = value.item()
        if isinstance(value, bool) or value is None or isinstance(value, str | int):
            out[str(key)] = value
        elif isinstance(value, float):
            out[str(key)] = value if math.isfinite(value) else str(value)
        else:
            out[str(key)] = str(value)
    return out


def eval_summary(step: int, now: float, metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The held-out eval of one step's metrics (``eval/*`` keys, prefix dropped; its ``eval/step``,
    the step evaluated, when a late eval came with a later step), or None."""
    found = {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")}
    return {"step": step, "time": now, **found} if found else None


@dataclass
class AdapterRecord:
    """Mutable controller-side record; only :class:`ControllerCore` touches it (under its lock).

    ``step`` counts optimizer steps this run applied (only steps where the adapter trained);
    ``checkpoint_step`` is the step of ``last_checkpoint``, the point a restart resumes from.
    Queue time: ``pending_s`` is the time from registration to its first RUNNING (so far, while
    PENDING); ``parked_s`` the time it spent RUNNING or DRAINING without a slot (waiting for a turn).
    """

    name: str
    run_id: str
    seq: int  # registration order: FIFO key for free slots
    spec: AdapterSpec
    spec_dict: dict[str, Any] = field(default_factory=dict)  # ``spec`` as JSON, computed once
    remote: bool = False  # submitted over the network (only operator-registered code allowed)
    state: AdapterState = AdapterState.PENDING
    slot: int | None = None
    step: int = 0
    last_checkpoint: str | None = None
    checkpoint_step: int = 0
    needs_init: bool = False
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float = field(default_factory=time.time)
    metrics: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=METRICS_HISTORY))
    last_eval: dict[str, Any] | None = None  # the latest held-out eval: step, time, reward_mean, ...
    served_tokens: float = 0.0  # tokens trained so far (the turn rule's fair share)
    resident_steps: int = 0  # steps reported since it last got a slot
    parked_s: float = 0.0  # time RUNNING/DRAINING without a slot, up to parked_since
    parked_since: float | None = None  # when it last lost (or never had) a slot while RUNNING

    @property
    def tenant(self) -> str:
        return tenant_of(self.spec)

    def queue_times(self, now: float | None = None) -> dict[str, float]:
        """``pending_s`` and ``parked_s`` at ``now`` (a finished run: at its end)."""
        if self.finished_at is not None:
            now = self.finished_at
        elif now is None:
            now = time.time()
        started = self.started_at if self.started_at is not None else now
        parked = self.parked_s + (now - self.parked_since if self.parked_since is not None else 0.0)
        return {"pending_s": max(0.0, started - self.created_at), "parked_s": max(0.0, parked)}

    def mark_parked(self, parked: bool, now: float) -> None:
        """Account the time waiting for a turn: ``parked`` says it has no slot from ``now`` on."""
        if parked and self.parked_since is None:
            self.parked_since = now
        elif not parked and self.parked_since is not None:
            self.parked_s += max(0.0, now - self.parked_since)
            self.parked_since = None

    def public(self, with_spec: bool = False, now: float | None = None) -> dict[str, Any]:
        """Plain JSON-able view for ``get``/``list`` and the HTTP API (queue times at ``now``)."""
        out: dict[str, Any] = {
            "name": self.name,
            "run_id": self.run_id,
            "tenant": self.tenant,
            "state": self.state.value,
            "slot": self.slot,
            "step": self.step,
            "num_steps": self.spec.num_steps,
            "num_epochs": self.spec.num_epochs,
            "rank": self.spec.rank,
            "last_checkpoint": self.last_checkpoint,
            "checkpoint_step": self.checkpoint_step,
            "reason": self.reason,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "updated_at": self.updated_at,
            "metrics": [dict(m) for m in self.metrics],
            "last_eval": copy.deepcopy(self.last_eval),
            "served_tokens": self.served_tokens,
            **self.queue_times(now),
        }
        if with_spec:
            out["spec"] = copy.deepcopy(self.spec_dict)
        return out

    def history_entry(self) -> dict[str, Any]:
        """The finished run as the run history keeps it: public record, spec, final metrics."""
        entry = self.public(with_spec=True)
        entry["metrics"] = entry["metrics"][-FINISHED_METRICS:]
        entry.update(seq=self.seq, remote=self.remote)
        return entry

    def to_state(self) -> dict[str, Any]:
        """Everything needed to rebuild the live record after a restart (JSON-able)."""
        return {
            "name": self.name,
            "run_id": self.run_id,
            "seq": self.seq,
            "remote": self.remote,
            "spec": self.spec_dict,
            "state": self.state.value,
            "slot": self.slot,
            "step": self.step,
            "last_checkpoint": self.last_checkpoint,
            "checkpoint_step": self.checkpoint_step,
            "needs_init": self.needs_init,
            "reason": self.reason,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "updated_at": self.updated_at,
            "metrics": list(self.metrics),
            "last_eval": self.last_eval,
            "served_tokens": self.served_tokens,
            "resident_steps": self.resident_steps,
            "parked_s": self.parked_s,
            "parked_since": self.parked_since,
        }

    @classmethod
    def from_state(cls, data: dict[str, Any], spec: AdapterSpec) -> AdapterRecord:
        fields = {k: v for k, v in data.items() if k not in ("spec", "state", "metrics")}
        record = cls(spec=spec, spec_dict=data["spec"], state=AdapterState(data["state"]), **fields)
        record.metrics.extend(data.get("metrics", []))
        return record


def public_from_history(entry: dict[str, Any], with_spec: bool = False) -> dict[str, Any]:
    """A history entry as :meth:`AdapterRecord.public` shows a record."""
    drop = HISTORY_ONLY_KEYS if with_spec else (*HISTORY_ONLY_KEYS, "spec")
    return {**{k: v for k, v in entry.items() if k not in drop}, "quota": None}
