"""JSON over HTTP for the rollout servers' clients: one call, one clear error.

Each thread keeps its own ``requests.Session`` (connections are reused; sessions are not shared
between threads). A failed call raises :class:`ServerError` with the status, the server's own
message and whether trying again may help (unreachable, timeouts and 5xx answers are transient;
4xx answers are refusals).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import requests

from miles_multilora.rollout.engine import RolloutError

_local = threading.local()


class ServerError(RolloutError):
    """A rollout server could not be reached or refused a call.

    ``status`` is the HTTP status (None when unreachable), ``message`` the server's own error text.
    """

    def __init__(self, url: str, path: str, status: int | None, message: str) -> None:
        self.url, self.path, self.status, self.message = url, path, status, message
        what = "unreachable" if status is None else f"answered {status}"
        super().__init__(f"{url}{path} {what}: {message}")

    @property
    def transient(self) -> bool:
        """Unreachable, timed out or a server-side failure: trying again later may succeed."""
        return self.status is None or self.status >= 500

    def __reduce__(self) -> tuple:
        return (type(self), (self.url, self.path, self.status, self.message))


def _session() -> requests.Session:
    session = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def call(method: str, url: str, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
    """``method url+path`` with a JSON body; the decoded JSON answer (or its text, or None when empty)."""
    try:
        resp = _session().request(method, url + path, json=payload, timeout=timeout_s)
    except requests.RequestException as exc:
        raise ServerError(url, path, None, str(exc)) from exc
    if resp.status_code >= 400:
        raise ServerError(url, path, resp.status_code, error_text(resp))
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text


def error_text(resp: requests.Response) -> str:
    """The message of an error answer, in the shapes vLLM, SGLang and FastAPI use."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason or ""
    if isinstance(body, dict):
        for key in ("error_message", "error", "message", "detail"):
            err = body.get(key)
            if err:
                if isinstance(err, dict):
                    return str(err.get("message") or err)
                return err if isinstance(err, str) else json.dumps(err)[:500]
    return str(body)[:500]
