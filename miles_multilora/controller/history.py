"""Finished runs: an append-only JSONL file plus an in-memory index, bounded by a retention count.

The controller's state file holds only live runs (so writing it stays cheap however long the
service runs); a run that ends is appended here as one line (fsynced) before the state file
drops it. Lines are plain JSON (public record + spec as a dict), read back without re-validating
any spec. When the file holds more than twice ``retention`` lines it is rewritten atomically
with the newest ``retention``. The file is readable by its owner only.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from miles_multilora.controller.errors import ControllerStateError
from miles_multilora.private_files import private_open, write_atomic

HISTORY_FILE_NAME = "controller_history.jsonl"


class RunHistory:
    """Finished runs by run id (oldest first), and the latest finished run of each name."""

    def __init__(self, state_dir: str | Path | None, retention: int) -> None:
        if retention < 1:
            raise ValueError(f"retention must be >= 1, got {retention}")
        self.retention = retention
        self.path = Path(state_dir) / HISTORY_FILE_NAME if state_dir is not None else None
        self._runs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._latest: dict[str, str] = {}  # name -> run id
        self._lines = 0

    # ------------------------------------------------------------------ reads
    def __contains__(self, run_id: str) -> bool:
        return run_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def latest(self, name: str) -> dict[str, Any] | None:
        run_id = self._latest.get(name)
        return self._runs[run_id] if run_id is not None else None

    def entries(self) -> list[dict[str, Any]]:
        return list(self._runs.values())

    def latest_entries(self) -> list[dict[str, Any]]:
        return [self._runs[r] for r in self._latest.values()]

    # ----------------------------------------------------------------- writes
    def load(self) -> None:
        """Read the file (a torn last line from a crash is skipped); keep the newest ``retention``."""
        if self.path is None or not self.path.is_file():
            return
        try:
            raw = self.path.read_bytes().splitlines()
        except OSError as exc:
            raise ControllerStateError(f"cannot read run history {self.path}: {exc}") from exc
        for i, line in enumerate(raw):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if i == len(raw) - 1:  # the write that a crash interrupted
                    continue
                raise ControllerStateError(f"{self.path} line {i + 1} is not JSON: {exc}") from exc
            self._index(entry)
        self._lines = len(raw)

    def append(self, entry: dict[str, Any]) -> None:
        """Record one finished run durably, then index it."""
        if self.path is not None:
            with private_open(self.path, "ab") as f:
                f.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            self._lines += 1
        self._index(entry)
        if self.path is not None and self._lines > 2 * self.retention:
            self._compact()

    def _index(self, entry: dict[str, Any]) -> None:
        run_id, name = str(entry["run_id"]), str(entry["name"])
        self._runs.pop(run_id, None)
        self._runs[run_id] = entry
        current = self._latest.get(name)
        if current is None or int(self._runs[current]["seq"]) <= int(entry["seq"]):
            self._latest[name] = run_id
        while len(self._runs) > self.retention:
            old_id, old = self._runs.popitem(last=False)
            if self._latest.get(old["name"]) == old_id:
                del self._latest[old["name"]]

    def _compact(self) -> None:
        assert self.path is not None
        write_atomic(
            self.path, b"".join(json.dumps(e, sort_keys=True).encode() + b"\n" for e in self._runs.values())
        )
        self._lines = len(self._runs)
