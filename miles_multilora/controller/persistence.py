"""Atomic JSON state file of the controller.

The state is written to a temp file in the same directory, fsynced, then ``os.replace``-d over
``controller_state.json`` (and the directory fsynced), so a reader sees either the previous or
the new complete file, never a half-written one. Temp leftovers of a crash (``.*.tmp`` names)
are never read. Files are readable by their owner only (:mod:`miles_multilora.private_files`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import AdapterSpec, parse_adapter_spec
from miles_multilora.controller.errors import ControllerStateError
from miles_multilora.controller.history import RunHistory
from miles_multilora.controller.quotas import TokenWindow
from miles_multilora.controller.record import AdapterRecord
from miles_multilora.controller.slot_table import SlotTable
from miles_multilora.controller.states import AdapterState
from miles_multilora.errors import SpecError
from miles_multilora.private_files import write_atomic

STATE_FILE_NAME = "controller_state.json"
STATE_FORMAT_VERSION = 1


def state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATE_FILE_NAME


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file + fsync + os.replace), ``0600``."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def save_state(state_dir: str | Path, state: dict[str, Any]) -> None:
    write_json_atomic(state_path(state_dir), {"format_version": STATE_FORMAT_VERSION, **state})


def load_state(state_dir: str | Path) -> dict[str, Any] | None:
    """The last complete state in ``state_dir``, or None when none was ever written.

    Raises :class:`ControllerStateError` when the file exists but cannot be parsed (it is never
    silently replaced by an empty state, which would lose every adapter).
    """
    path = state_path(state_dir)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControllerStateError(f"cannot read controller state {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format_version") != STATE_FORMAT_VERSION:
        raise ControllerStateError(
            f"{path} is not a controller state file of format {STATE_FORMAT_VERSION}; "
            "move it away or point state_dir elsewhere"
        )
    return data


class PersistedState:
    """The :class:`~miles_multilora.controller.core.ControllerCore`'s live state in its state file:
    what is saved, how it is loaded, and the write after every change (rolled back on failure)."""

    num_slots: int
    max_rank: int
    _seq: int
    _snapshot_id: int
    _as_of: float
    _runs: dict[str, AdapterRecord]
    _latest: dict[str, str]
    _history: RunHistory
    _slots: SlotTable
    _tokens: TokenWindow
    _state_dir: Path | None
    _saved: dict[str, Any] | None

    def _finish(self, record: AdapterRecord, target: AdapterState, reason: str | None) -> None:
        raise NotImplementedError  # the core's

    def _to_state(self) -> dict[str, Any]:
        return {
            "num_slots": self.num_slots,
            "max_rank": self.max_rank,
            "seq": self._seq,
            "snapshot_id": self._snapshot_id,
            **self._slots.to_state(),
            "runs": [r.to_state() for r in self._runs.values()],
            "tenant_tokens": self._tokens.to_state(),
            "as_of": self._as_of,
        }

    def _load(self, data: dict[str, Any], reset_slots: bool) -> None:
        """Live runs from a state dict (runs the history already holds as finished are dropped:
        a crash hit between the two writes of :meth:`_finish`)."""
        self._seq = int(data["seq"])
        self._snapshot_id = int(data["snapshot_id"])
        self._tokens.load(data.get("tenant_tokens"))
        self._as_of = float(data.get("as_of", self._as_of))
        self._runs = {}
        invalid: list[tuple[AdapterRecord, str]] = []
        for item in data["runs"]:
            if item["run_id"] in self._history:
                continue
            try:
                spec = parse_adapter_spec(item["spec"])
            except SpecError as exc:  # e.g. the schema changed since it was saved
                spec, error = AdapterSpec(name=item["name"]), str(exc)
            else:
                error = None
            record = AdapterRecord.from_state(item, spec)
            if record.state.finished:  # a state file of an earlier version kept finished runs
                self._history.append(record.history_entry())
                continue
            self._runs[item["run_id"]] = record
            if error is not None:
                invalid.append((record, error))
        self._latest = {r.name: r.run_id for r in self._runs.values()}
        if reset_slots:
            self._slots.reset()
        else:
            self._slots.load(data)
        for record, error in invalid:
            record.slot = None if reset_slots else record.slot
            self._finish(record, AdapterState.FAILED, reason=f"stored spec invalid: {error}")

    def _commit(self) -> None:
        """Persist the current state; if writing fails, roll memory back to the last saved state."""
        if self._state_dir is None:
            return
        state = self._to_state()
        try:
            save_state(self._state_dir, state)
        except BaseException:
            if self._saved is not None:
                self._load(self._saved, reset_slots=False)
            raise
        self._saved = state
