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

from miles_multilora.controller.errors import ControllerStateError
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
