"""One registration of one adapter (a *run*), as the controller keeps and persists it."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.controller.states import AdapterState

METRICS_HISTORY = 20  # recent per-step metric entries kept per adapter


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


@dataclass
class AdapterRecord:
    """Mutable controller-side record; only :class:`ControllerCore` touches it (under its lock).

    ``step`` counts optimizer steps this run applied (only steps where the adapter trained);
    ``checkpoint_step`` is the step of ``last_checkpoint``, the point a restart resumes from.
    """

    name: str
    run_id: str
    seq: int  # registration order: FIFO key for free slots
    spec: AdapterSpec
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

    def public(self, with_spec: bool = False) -> dict[str, Any]:
        """Plain JSON-able view for ``get``/``list`` and the HTTP API."""
        out: dict[str, Any] = {
            "name": self.name,
            "run_id": self.run_id,
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
        }
        if with_spec:
            out["spec"] = self.spec.to_dict()
        return out

    def to_state(self) -> dict[str, Any]:
        """Everything needed to rebuild the record after a restart (JSON-able)."""
        return {
            "name": self.name,
            "run_id": self.run_id,
            "seq": self.seq,
            "spec": self.spec.to_dict(),
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
        }

    @classmethod
    def from_state(cls, data: dict[str, Any], spec: AdapterSpec) -> AdapterRecord:
        fields = {k: v for k, v in data.items() if k not in ("spec", "state", "metrics")}
        record = cls(spec=spec, state=AdapterState(data["state"]), **fields)
        record.metrics.extend(data.get("metrics", []))
        return record
