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
413 body over ``controller.max_body_mb``, 415 body not ``application/json``, 500 unexpected (logged),
503 over a cap on connections or requests in flight (with ``Retry-After``).

Auth: with a token, every route except ``/health``, ``/docs`` and ``/openapi.json`` (which stay
open) needs ``Authorization: Bearer <token>``. A non-loopback host requires a token; loopback
without one logs a warning. Specs POSTed here are registered with ``remote=True``. The serving
itself (auth guard, body limits, 500 guard, connection and request caps, head deadline, keep-alive:
the ``controller`` section's :class:`~miles_multilora.config.http_limits.HTTPLimits`) is
:mod:`miles_multilora.http_serving`, shared with ``tinker-serve``.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import Callable
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.config.sections.controller import ControllerConfig
from miles_multilora.controller.core import ControllerCore
from miles_multilora.controller.errors import ControllerAuthError, ControllerError
from miles_multilora.errors import ConfigError
from miles_multilora.http_serving import LOOPBACK_HOSTS, BackgroundServer, Guard, HTTPProblem, read_body

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32  # a spec nests 3 levels; deeper input is refused before the core sees it
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
        raise HTTPProblem(400, f"body is not UTF-8: {exc}", "<body>") from exc
    except RecursionError as exc:
        raise HTTPProblem(400, "body is not valid JSON: nested too deeply", "<body>") from exc
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity
        raise HTTPProblem(400, f"body is not valid JSON: {exc}", "<body>") from exc
    if not isinstance(data, dict):
        raise HTTPProblem(400, f"an adapter spec must be a JSON object, got {type(data).__name__}", "<body>")
    if _depth(data) > MAX_JSON_DEPTH:
        raise HTTPProblem(400, f"body nests deeper than {MAX_JSON_DEPTH} levels", "<body>")
    return data


def _authenticator(token: str) -> Callable[[Scope], bool | None]:
    """The guard's check of ``Authorization: Bearer <token>`` (constant-time)."""

    def authenticate(scope: Scope) -> bool | None:
        header = dict(scope["headers"]).get(b"authorization", b"")
        given = header[len(b"Bearer ") :] if header.startswith(b"Bearer ") else b""
        return True if hmac.compare_digest(given, token.encode()) else None

    return authenticate


def _render(status: int, message: str, type_: str, headers: dict[str, str]) -> JSONResponse:
    return _error(status, message, type_, headers=headers)


def create_app(
    core: ControllerCore,
    token: str | None = None,
    limits: HTTPLimits | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """The FastAPI app over ``core`` (blocking core calls run in the threadpool); ``limits``: the
    ``controller`` section's defaults unless given (``max_body_bytes`` overrides its body limit)."""
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
    app.add_middleware(
        Guard,
        render=_render,
        logger=logger,
        limits=limits or HTTPLimits.of(ControllerConfig()),
        max_body_bytes=max_body_bytes,
        authenticate=_authenticator(token) if token is not None else None,
        open_paths=OPEN_PATHS,
        unauthorized=(
            "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
            ControllerAuthError.__name__,
            {"WWW-Authenticate": "Bearer"},
        ),
    )

    @app.exception_handler(HTTPProblem)
    async def _on_http_error(request: Request, exc: HTTPProblem) -> JSONResponse:
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
            raise HTTPProblem(
                415,
                f"send the adapter spec as JSON (Content-Type: application/json), got {got}; "
                "`miles-multilora submit` converts YAML files",
            )
        body = await read_body(request, required="the adapter spec as a JSON object")
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


class ControllerHTTPServer:
    """Serves a :class:`ControllerCore` over HTTP from a daemon thread of this process.

    ``start()`` binds, waits until the server accepts connections and returns the URL
    (``http://host:port``; ``port=0`` picks a free port); ``stop()`` shuts it down (idempotent).
    ``limits``: the ``controller`` section's (default: its defaults); ``max_body_bytes`` overrides
    its body limit.
    """

    def __init__(
        self,
        core: ControllerCore,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        limits: HTTPLimits | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        if token is not None and not token:
            raise ConfigError(
                "token", "an empty bearer token is not allowed; leave it unset (None) to disable auth"
            )
        self._core, self._host, self._port, self._token = core, host, port, token
        self._limits, self._max_body_bytes = limits or HTTPLimits.of(ControllerConfig()), max_body_bytes
        self._server: BackgroundServer | None = None

    @property
    def url(self) -> str:
        if self._server is None or self._server.url is None:
            raise ControllerError("the controller HTTP server is not started")
        return self._server.url

    def start(self) -> str:
        if self._server is not None and self._server.url is not None:
            return self._server.url
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
        server = BackgroundServer(
            create_app(self._core, self._token, self._limits, self._max_body_bytes),
            self._host,
            self._port,
            name="controller-http",
            port_key="controller.port",
            logger=logger,
            limits=self._limits,
        )
        try:
            url = server.start()
        except RuntimeError as exc:
            raise ControllerError(str(exc)) from exc
        self._server = server
        logger.info("controller HTTP API on %s", url)
        return url

    def stop(self) -> None:
        """Stop accepting, close connections, wait for requests in flight, join the thread."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
