"""``retrieve_future``: the long poll for a queued operation's result (JSON, or protobuf for
forward/backward and sampling), a ``try_again`` (408) after the app's ``poll_s``, or a 503 while
the server stops."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from miles_multilora.tinker import params
from miles_multilora.tinker.futures import Gone
from miles_multilora.tinker.route_kit import API, State, Tenant, body_of, problem

router = APIRouter()


@router.post(f"{API}/retrieve_future")
async def retrieve_future(request: Request, state: State, tenant: Tenant) -> Any:
    body, futures, registry = await body_of(request), state.futures, state.registry
    try:
        entry = futures.get(tenant, params.text(body, "request_id"))
    except Gone as exc:
        return {"error": exc.message, "category": exc.category}
    ready = asyncio.wrap_future(entry.ready)
    deadline = asyncio.get_running_loop().time() + request.app.state.poll_s
    registry.heard_from(entry.tenant, entry.session_id)  # a client polling keeps its session alive
    while not ready.done():  # in short waits, so that a stopping server lets go of its long polls
        if state.stopping.is_set():
            return problem(503, "the server is stopping; poll again", headers={"Connection": "close"})
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            try_again = {"type": "try_again", "request_id": entry.request_id, "queue_state": "active"}
            return JSONResponse(try_again, status_code=408)
        await asyncio.wait([ready], timeout=min(remaining, 0.25))
        registry.heard_from(entry.tenant, entry.session_id)
    outcome = ready.result()
    futures.retrieved(entry)
    return Response(outcome.body, media_type=outcome.media_type)
