"""What every Tinker route shares: the server state and the caller's tenant as FastAPI
dependencies, the JSON body, the error shape, and queueing an operation as a future.

A malformed field is a 400 naming it (``category: user``); a server-side failure is ``category:
server``. Routes take :data:`State` and :data:`Tenant` as parameters; nothing is captured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from miles_multilora.http_serving import read_body
from miles_multilora.tinker import params
from miles_multilora.tinker.batching_queue import Work
from miles_multilora.tinker.registry import OwnedModel
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.state import ServerState, encoder

API = "/api/v1"


def problem(
    status: int, detail: str, field_: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error answer: ``{"detail", "category"}`` (and ``field`` when one field is to blame)."""
    body = {"detail": detail, "category": "server" if status >= 500 else "user"}
    if field_ is not None:
        body["field"] = field_
    return JSONResponse(body, status_code=status, headers=headers)


async def server_state(request: Request) -> ServerState:
    return request.app.state.tinker


async def tenant_of(request: Request) -> str:
    """The caller's tenant, as the app's guard authenticated it."""
    return request.state.principal


State = Annotated[ServerState, Depends(server_state)]
Tenant = Annotated[str, Depends(tenant_of)]


async def body_of(request: Request) -> dict[str, Any]:
    return params.json_body(await read_body(request, required="a JSON object"))


async def drain(request: Request) -> None:
    """Read (and drop) a body this route does not need, within the body limits."""
    try:
        async for _ in request.stream():
            pass
    except ClientDisconnect:
        pass


def submit(
    state: ServerState, tenant: str, key: Any, kind: str, lane: Any, calls: list[Work],
    combine: Callable[[list[Any]], Any] = lambda r: r[0], costs: list[int] | None = None,
    body: dict[str, Any] | None = None, trains: str | None = None,
) -> str:  # fmt: skip
    """Queue ``calls`` in ``lane`` as one future of ``tenant`` (``key``: its idempotency key, or
    None; ``body``: the request's, so a retry under ``key`` with another body is refused); its
    request id. ``trains``: the model whose weights the calls step (:meth:`BatchingQueue.submit_calls`)."""
    return state.futures.submit(
        tenant,
        key,
        lambda: state.queue.submit_calls(lane, calls, combine, costs, trains),
        encoder(kind),
        lane[1],
        body,
    )


def lane(owned: OwnedModel) -> tuple[str, str]:
    """The queue lane of a model's operations: its tenant's session."""
    return (owned.tenant, owned.session_id)


def adamw_only(body: dict[str, Any]) -> None:
    """``optimizer_config``: AdamW (the SDK's default) is the one optimizer served."""
    config = body.get("optimizer_config")
    if config is None:
        return
    kind = config.get("type") if isinstance(config, dict) else None
    if kind != "adamw" or set(config) != {"type"}:
        raise TinkerError(
            "optimizer_config",
            f"only AdamW ({{'type': 'adamw'}}, the SDK's default) is served; got {config!r}",
        )
