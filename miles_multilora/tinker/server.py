"""The Tinker REST protocol (as the pinned ``tinker`` SDK speaks it), over HTTP.

Every route checks its fields (a malformed field is a 400 naming it, ``category: user``; an id the
caller's tenant does not own is a 404 exactly like an unknown one), then queues its operation
(:class:`~miles_multilora.tinker.state.ServerState`) on the
:class:`~miles_multilora.tinker.batching_queue.BatchingQueue` in its session's lane and answers with a
request id. ``retrieve_future`` long-polls for the result: JSON for most operations, protobuf for
forward/backward and sampling; a failure is ``{"error", "category"}`` (``user`` for anything the
request itself got wrong, ``server`` otherwise).

The routes are in modules of their own, by group: :mod:`.session_routes` (client and sessions),
:mod:`.model_routes` (models and training), :mod:`.weight_routes` (saving and loading weights),
:mod:`.sampling_routes`, :mod:`.future_routes` and :mod:`.rest_routes` (the SDK's REST surface); each
takes the server state and the caller's tenant as dependencies (:mod:`.route_kit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.errors import ConfigError
from miles_multilora.http_serving import Guard, HTTPProblem
from miles_multilora.tinker import (
    future_routes,
    model_routes,
    rest_routes,
    sampling_routes,
    session_routes,
    weight_routes,
)
from miles_multilora.tinker.batching_queue import QueueStopped
from miles_multilora.tinker.futures import Busy
from miles_multilora.tinker.registry import Unknown
from miles_multilora.tinker.route_kit import problem
from miles_multilora.tinker.state import ServerState

logger = logging.getLogger(__name__)


def render(status: int, message: str, type_: str, headers: dict[str, str]) -> JSONResponse:
    """The guard's errors (401, 408, 413, 500) in this door's shape; the connection then closes."""
    return problem(status, message, headers={"Connection": "close", **headers})


async def _on_problem(request: Request, exc: HTTPProblem) -> JSONResponse:
    return problem(exc.status, exc.message, exc.field, headers={"Connection": "close"})


async def _on_unknown(request: Request, exc: Unknown) -> JSONResponse:
    return problem(404, exc.message, exc.key)


async def _on_bad_request(request: Request, exc: ConfigError) -> JSONResponse:
    return problem(400, str(exc), exc.key)


async def _on_stopping(request: Request, exc: QueueStopped) -> JSONResponse:
    return problem(503, str(exc), headers={"Connection": "close"})


async def _on_busy(request: Request, exc: Busy) -> JSONResponse:
    return problem(429, str(exc), headers={"Retry-After": "1"})


async def _on_routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return problem(exc.status_code, str(exc.detail), headers=exc.headers)


ERRORS: dict[type[Exception], Callable[..., Any]] = {
    HTTPProblem: _on_problem,
    Unknown: _on_unknown,
    ConfigError: _on_bad_request,  # TinkerError and SpecError (e.g. an unknown loss) included
    QueueStopped: _on_stopping,
    Busy: _on_busy,
    StarletteHTTPException: _on_routing_error,
}
ROUTERS = (session_routes, model_routes, weight_routes, sampling_routes, future_routes)


def create_app(
    state: ServerState, *, authenticate: Callable[[Any], str | None], poll_s: float = 25.0
) -> FastAPI:
    """The app: ``authenticate(scope)`` gives the caller's tenant (or None: 401); its HTTP limits
    are ``state.settings``'; ``retrieve_future`` answers ``try_again`` after ``poll_s``."""
    app = FastAPI(title="miles_multilora tinker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = state
    app.state.poll_s = poll_s
    app.add_middleware(
        Guard,
        render=render,
        logger=logger,
        limits=HTTPLimits.of(state.settings),
        authenticate=authenticate,
        open_paths=rest_routes.OPEN_PATHS,
        unauthorized=("missing or wrong X-API-Key", "AuthError", {}),
    )
    for error, handler in ERRORS.items():
        app.add_exception_handler(error, handler)
    for routes in ROUTERS:
        app.include_router(routes.router)
    rest_routes.register(app, state)  # runs, checkpoints, weights info, sessions, external weights
    return app
