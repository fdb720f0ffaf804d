"""Small JSON HTTP API over a :class:`ControllerCore` (stdlib ``ThreadingHTTPServer``).

Routes (every response is JSON)::

    GET    /health               200 {"status": "ok", "num_slots", "adapters": {state: n}, "slots": {...}}
    POST   /adapters             201 record      body: an adapter spec, YAML or JSON (by Content-Type,
                                                 else sniffed: a body starting with "{" is JSON)
    GET    /adapters[?all_runs=1] 200 {"adapters": [record, ...]}
    GET    /adapters/{name}      200 record (with "spec")
    DELETE /adapters/{name}      200 record      (cancel: PENDING -> CANCELLED, RUNNING -> DRAINING)

Errors: ``{"error": message, "type": error class}`` plus ``"field"`` (the spec key to change) on
400; 401 missing or
wrong bearer token (when a token is set; ``/health`` stays open), 404 unknown adapter or route,
405 wrong method, 409 live duplicate name / adapter already finished, 411/413 body missing/too big.
Binds 127.0.0.1 by default; ``port=0`` picks a free port (see :attr:`ControllerHTTPServer.url`).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from miles_multilora.controller.core import ControllerCore
from miles_multilora.controller.errors import ControllerError
from miles_multilora.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def parse_spec_body(body: bytes, content_type: str | None) -> dict[str, Any]:
    """Decode a POSTed spec (JSON or YAML) into a dict; raises a 400 naming the body."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _HTTPError(400, f"body is not UTF-8: {exc}", "<body>") from exc
    media = (content_type or "").split(";")[0].strip().lower()
    as_json = media in JSON_TYPES or (media not in YAML_TYPES and text.lstrip().startswith("{"))
    try:
        data = json.loads(text) if as_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise _HTTPError(400, f"body is not valid {'JSON' if as_json else 'YAML'}: {exc}", "<body>") from exc
    if not isinstance(data, dict):
        raise _HTTPError(400, f"an adapter spec must be a mapping, got {type(data).__name__}", "<body>")
    return data


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self, method: str) -> None:
        try:
            status, body = self._route(method)
        except _HTTPError as exc:
            status, body = exc.status, {"error": exc.message, **({"field": exc.field} if exc.field else {})}
        except ConfigError as exc:  # includes SpecError
            status, body = 400, {"error": exc.message, "field": exc.key, "type": type(exc).__name__}
        except ControllerError as exc:
            status, body = exc.http_status, {"error": exc.message, "type": type(exc).__name__}
        except Exception as exc:  # keep the server alive; the caller sees a 500 with the message
            logger.exception("controller HTTP API: %s %s failed", method, self.path)
            status, body = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        if status >= 400:
            self.close_connection = True  # a request body may be left unread
        self._send(status, body)

    def _route(self, method: str) -> tuple[int, Any]:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/") if p]
        core = self.server.core
        if parts == ["health"]:
            self._allow(method, "GET")
            return 200, core.health()
        self._authorize()
        if parts == ["adapters"]:
            self._allow(method, "GET", "POST")
            if method == "POST":
                return 201, core.register(
                    parse_spec_body(self._read_body(), self.headers.get("Content-Type"))
                )
            all_runs = parse_qs(url.query).get("all_runs", ["0"])[-1].lower() in ("1", "true", "yes")
            return 200, {"adapters": core.list(all_runs=all_runs)}
        if len(parts) == 2 and parts[0] == "adapters":
            self._allow(method, "GET", "DELETE")
            return 200, core.get(parts[1]) if method == "GET" else core.cancel(parts[1])
        raise _HTTPError(404, f"no route {url.path}; see GET /health, /adapters, /adapters/{{name}}")

    def _allow(self, method: str, *allowed: str) -> None:
        if method not in allowed:
            raise _HTTPError(405, f"{method} not allowed here; use {' or '.join(allowed)}")

    def _authorize(self) -> None:
        token = self.server.token
        if token is None:
            return
        header = self.headers.get("Authorization", "")
        given = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise _HTTPError(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')")

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise _HTTPError(411, "Content-Length is required")
        if int(length) > self.server.max_body_bytes:
            raise _HTTPError(413, f"body larger than {self.server.max_body_bytes} bytes")
        return self.rfile.read(int(length))

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")  # so keep-alive clients open a new connection
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    core: ControllerCore
    token: str | None
    max_body_bytes: int


class ControllerHTTPServer:
    """Serves a :class:`ControllerCore` over HTTP in a background thread.

    ``start()`` binds and returns the URL (``http://host:port``); ``stop()`` shuts it down.
    """

    def __init__(
        self,
        core: ControllerCore,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if token is not None and not token:
            raise ConfigError(
                "token", "an empty bearer token is not allowed; leave it unset (None) to disable auth"
            )
        self._core, self._host, self._port = core, host, port
        self._token, self._max_body_bytes = token, max_body_bytes
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise ControllerError("the controller HTTP server is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        if self._server is not None:
            return self.url
        try:
            server = _Server((self._host, self._port), _Handler)
        except OSError as exc:
            raise ConfigError("controller.port", f"cannot bind {self._host}:{self._port}: {exc}") from exc
        server.core, server.token, server.max_body_bytes = self._core, self._token, self._max_body_bytes
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="controller-http", daemon=True)
        self._thread.start()
        logger.info("controller HTTP API on %s", self.url)
        if self._token is None and self._host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("controller HTTP API listens on %s without a bearer token", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None
