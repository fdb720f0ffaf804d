"""The controller's endpoint file: where a service's HTTP API listens, for scripts and the CLI.

The actor writes ``<state_dir>/controller_endpoint.json`` (atomically) once its server is up:
``{"url": ..., "name": ..., "namespace": ...}``. The bearer token is never written there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_multilora.controller.errors import ControllerUnavailableError
from miles_multilora.controller.persistence import write_json_atomic

ENDPOINT_FILE_NAME = "controller_endpoint.json"


def write_endpoint(state_dir: str | Path, url: str, name: str, namespace: str) -> Path:
    path = Path(state_dir) / ENDPOINT_FILE_NAME
    write_json_atomic(path, {"url": url, "name": name, "namespace": namespace})
    return path


def read_endpoint(state_dir: str | Path) -> dict[str, Any]:
    path = Path(state_dir) / ENDPOINT_FILE_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ControllerUnavailableError(
            f"no controller endpoint in {path} ({exc}); is the service running with this state_dir?"
        ) from exc
    if not isinstance(data, dict) or "url" not in data:
        raise ControllerUnavailableError(f"{path} has no 'url'")
    return data
