"""JSON HTTP API over a :class:`ControllerCore` (FastAPI, served by uvicorn in a background thread).

Routes (every response of the API is JSON; ``/docs`` is the Swagger UI page)::

    GET    /health                200 {"status": "ok", "num_slots", "adapters": {state: n}, "slots": {...},
                                      "trainer_restarts": n}
    POST   /adapters              201 record      body: an adapter spec as a JSON object
                                                  (Content-Type: application/json)
    GET    /adapters[?all_runs=1] 200 {"adapters": [record, ...]}
    GET    /adapters/{name}       200 record (with "spec")
    DELETE /adapters/{name}       200 record      (cancel: PENDING -> CANCELLED, RUNNING -> DRAINING)
    GET    /docs, /openapi.json   API docs

Errors: ``{"error": message, "type": error class}`` plus ``"field"`` (the spec key to change, or
``"<body>"``) on 400; 401 missing or wrong bearer token, 404 unknown adapter or route, 405 wrong
method, 408 body too slow, 409 live duplicate name / adapter already finished, 411 no body length,
413 body over ``max_body_bytes``, 415 body not ``application/json``, 500 unexpected (logged),
503 over the connection cap (uvicorn's plain-text answer).

Auth: with a token, every route except ``/health``, ``/docs`` and ``/openapi.json`` (which stay
open) needs ``Authorization: Bearer <token>``. A non-loopback host requires a token; loopback
without one logs a warning. Specs POSTed here are registered with ``remote=True``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import socket
import threading
import time
from typing import Any, NoReturn

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from miles_multilora.controller.core import ControllerCore
from miles_multilora.controller.errors import ControllerAuthError, ControllerError
from miles_multilora.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # a spec nests 3 levels; deeper input is refused before the core sees it
BODY_TIMEOUT_S = 30.0  # the whole request body must arrive within this
KEEP_ALIVE_S = 5.0  # idle connections (before the first request too) are closed after this
MAX_CONNECTIONS = 256  # open connections; a request on one more gets 503
BACKLOG = 2048
SHUTDOWN_TIMEOUT_S = 5.0
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
OPEN_PATHS = ("/health", "/docs", "/openapi.json")
TOKEN_HINT = "set $MILES_MULTILORA_TOKEN or controller.token_file"


class _JSON(JSONResponse):
    """Strict JSON; NaN/Infinity (a diverged adapter's metrics) are written as null."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:
            return super().render(_finite(content))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def _error(
    status: int, message: str, type_: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": message, "type": type_, **({"field": field} if field is not None else {})}
    # Close after an error: a request body may be left unread.
    return _JSON(body, status_code=status, headers={"Connection": "close", **(headers or {})})


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [
            child
            for node in level
            if isinstance(node, dict | list)
            for child in (node.values() if isinstance(node, dict) else node)
        ]
    return depth


def parse_spec_body(body: bytes) -> dict[str, Any]:
    """Decode a POSTed JSON spec into a dict; raises a 400 naming ``<body>``."""
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise _HTTPError(400, f"body is not UTF-8: {exc}", "<body>") from exc
    except RecursionError as exc:
        raise _HTTPError(400, "body is not valid JSON: nested too deeply", "<body>") from exc
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity
        raise _HTTPError(400, f"body is not valid JSON: {exc}", "<body>") from exc
    if not isinstance(data, dict):
        raise _HTTPError(400, f"an adapter spec must be a JSON object, got {type(data).__name__}", "<body>")
    if _depth(data) > MAX_JSON_DEPTH:
        raise _HTTPError(400, f"body nests deeper than {MAX_JSON_DEPTH} levels", "<body>")
    return data


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, read incrementally: 413 as soon as it passes ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is None and "chunked" not in request.headers.get("transfer-encoding", "").lower():
        raise _HTTPError(411, "a body with Content-Length is required: POST the adapter spec as JSON")
    if length is not None and int(length) > limit:  # h11 has checked that it is a number
        raise _HTTPError(413, f"body of {length} bytes is larger than the limit of {limit} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _HTTPError(413, f"body is larger than the limit of {limit} bytes")
    except TimeoutError as exc:
        raise _HTTPError(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s") from exc
    except ClientDisconnect as exc:
        raise _HTTPError(400, "the client disconnected while sending the body", "<body>") from exc
    if not body:
        raise _HTTPError(400, "empty body: POST the adapter spec as a JSON object", "<body>")
    return bytes(body)


class _Guard:
    """ASGI middleware: bearer-token check (except on open paths) and a JSON 500 for anything else."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.token is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            message = "missing or wrong bearer token (send 'Authorization: Bearer <token>')"
            response = _error(
                401, message, ControllerAuthError.__name__, headers={"WWW-Authenticate": "Bearer"}
            )
            await response(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # keep serving; the caller sees a 500 with the message
            logger.exception("controller HTTP API: %s %s failed", scope["method"], scope["path"])
            if not started:
                await _error(500, f"internal error: {type(exc).__name__}: {exc}", type(exc).__name__)(
                    scope, receive, send
                )

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        header = dict(scope["headers"]).get(b"authorization", b"")
        given = header[len(b"Bearer ") :] if header.startswith(b"Bearer ") else b""
        return hmac.compare_digest(given, self.token.encode())


def create_app(
    core: ControllerCore, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The FastAPI app over ``core`` (blocking core calls run in the threadpool)."""
    app = FastAPI(
        title="miles_multilora controller",
        description=(
            "Register, inspect and cancel LoRA adapters. With a token, every route except /health, "
            "/docs and /openapi.json (open) needs 'Authorization: Bearer <token>'."
        ),
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
        redirect_slashes=False,
        default_response_class=_JSON,
    )
    app.add_middleware(_Guard, token=token)

    @app.exception_handler(_HTTPError)
    async def _on_http_error(request: Request, exc: _HTTPError) -> JSONResponse:
        return _error(exc.status, exc.message, "HTTPError", exc.field)

    @app.exception_handler(StarletteHTTPException)
    async def _on_routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.url.path}; see GET /docs"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} not allowed on {request.url.path}; use {allowed}"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message, "HTTPError", headers=exc.headers)

    @app.exception_handler(ConfigError)  # SpecError included
    async def _on_config_error(request: Request, exc: ConfigError) -> JSONResponse:
        return _error(400, exc.message, type(exc).__name__, exc.key)

    @app.exception_handler(ControllerError)
    async def _on_controller_error(request: Request, exc: ControllerError) -> JSONResponse:
        return _error(exc.http_status, exc.message, type(exc).__name__)

    @app.get("/health", summary="Adapter and slot counts (open: no token needed)")
    def health() -> JSONResponse:
        return _JSON(core.health())

    def register_body(body: bytes) -> dict[str, Any]:
        return core.register(parse_spec_body(body), remote=True)

    @app.post(
        "/adapters",
        status_code=201,
        summary="Register an adapter (PENDING)",
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
        },
    )
    async def register(request: Request) -> JSONResponse:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            got = f"Content-Type {media}" if media else "no Content-Type"
            raise _HTTPError(
                415,
                f"send the adapter spec as JSON (Content-Type: application/json), got {got}; "
                "`miles-multilora submit` converts YAML files",
            )
        body = await _read_body(request, max_body_bytes)
        return _JSON(await run_in_threadpool(register_body, body), status_code=201)

    @app.get("/adapters", summary="Latest run of every adapter (all_runs=1: every run)")
    def list_adapters(all_runs: str = "0") -> JSONResponse:
        return _JSON({"adapters": core.list(all_runs=all_runs.lower() in ("1", "true", "yes"))})

    @app.get("/adapters/{name}", summary="One adapter's latest run, with its spec")
    def get_adapter(name: str) -> JSONResponse:
        return _JSON(core.get(name))

    @app.delete("/adapters/{name}", summary="Cancel: PENDING -> CANCELLED, RUNNING -> DRAINING")
    def cancel_adapter(name: str) -> JSONResponse:
        return _JSON(core.cancel(name))

    return app


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: the keep-alive timer also runs until a request's headers are
    complete, so a connection that sends nothing (or trickles headers) is closed too."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self.handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._unset_keepalive_if_required()  # a request is being served


class ControllerHTTPServer:
    """Serves a :class:`ControllerCore` over HTTP from a daemon thread of this process.

    ``start()`` binds, waits until the server accepts connections and returns the URL
    (``http://host:port``; ``port=0`` picks a free port); ``stop()`` shuts it down (idempotent).
    """

    def __init__(
        self,
        core: ControllerCore,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        keep_alive_s: float = KEEP_ALIVE_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if token is not None and not token:
            raise ConfigError(
                "token", "an empty bearer token is not allowed; leave it unset (None) to disable auth"
            )
        self._core, self._host, self._port, self._token = core, host, port, token
        self._max_body_bytes, self._keep_alive_s, self._max_connections = (
            max_body_bytes,
            keep_alive_s,
            max_connections,
        )
        self._url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise ControllerError("the controller HTTP server is not started")
        return self._url

    def start(self) -> str:
        if self._url is not None:
            return self._url
        if self._token is None:
            if self._host not in LOOPBACK_HOSTS:
                raise ConfigError(
                    "controller.token",
                    f"a bearer token is required to serve on {self._host} (not loopback): {TOKEN_HINT}",
                )
            logger.warning(
                "controller HTTP API on %s has no bearer token: any local process can submit and cancel "
                "adapters; %s",
                self._host,
                TOKEN_HINT,
            )
        sock = self._bind()
        config = uvicorn.Config(
            create_app(self._core, self._token, self._max_body_bytes),
            http=_Protocol,
            ws="none",
            lifespan="off",
            loop="asyncio",
            log_config=None,  # leave this process's logging alone
            log_level="warning",
            access_log=False,
            server_header=False,
            proxy_headers=False,
            backlog=BACKLOG,
            timeout_keep_alive=self._keep_alive_s,  # type: ignore[arg-type]  (a float works)
            limit_concurrency=self._max_connections + 1,  # uvicorn counts the asking connection
            timeout_graceful_shutdown=int(SHUTDOWN_TIMEOUT_S),
        )
        server = uvicorn.Server(config)
        # Not the main thread, so uvicorn installs no signal handlers.
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="controller-http", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            server.should_exit = True
            thread.join(timeout=SHUTDOWN_TIMEOUT_S)
            sock.close()
            raise ControllerError(f"the controller HTTP server on {self._host}:{self._port} did not start")
        host, port = sock.getsockname()[:2]
        self._url = f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
        self._server, self._thread = server, thread
        logger.info("controller HTTP API on %s", self._url)
        return self._url

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # proto=IPPROTO_TCP: asyncio then sets TCP_NODELAY on every accepted connection (with proto 0
        # it does not, and keep-alive responses wait ~40 ms on Nagle + delayed ACK).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            raise ConfigError("controller.port", f"cannot bind {self._host}:{self._port}: {exc}") from exc
        return sock

    def stop(self) -> None:
        """Stop accepting, close connections, wait for requests in flight, join the thread."""
        server, thread = self._server, self._thread
        self._server = self._thread = self._url = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout=SHUTDOWN_TIMEOUT_S + 5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=5)
            logger.warning(
                "controller HTTP server thread did not stop in time (alive: %s)", thread.is_alive()
            )
