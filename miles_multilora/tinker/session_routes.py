"""The Tinker routes of a client and its sessions: the SDK's configuration, the server's
capabilities, sessions opened, kept alive by heartbeats and finished, and telemetry (accepted and
dropped)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from miles_multilora.tinker import params, rest_routes
from miles_multilora.tinker.futures import Busy
from miles_multilora.tinker.registry import Unknown
from miles_multilora.tinker.route_kit import API, State, Tenant, body_of, drain, problem

router = APIRouter()


@router.post(f"{API}/client/config")
async def client_config(request: Request) -> dict[str, Any]:
    await drain(request)
    return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False}


@router.post(f"{API}/client/dynamic_config")
async def dynamic_config(request: Request) -> dict[str, Any]:
    await drain(request)
    return {}


@router.get(f"{API}/get_server_capabilities")
async def capabilities(state: State) -> dict[str, Any]:
    model = {"model_name": state.base_model, "max_context_length": state.backend.rank.max_seq_len}
    return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}


@router.post(f"{API}/create_session")
async def create_session(request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    body, s, registry = await body_of(request), state.settings, state.registry
    metadata = rest_routes.user_metadata(body, s)
    rest_routes.project(body)
    name = rest_routes.display_name(body, s)
    if registry.count_sessions(tenant) >= s.max_sessions:
        raise Busy(
            f"this API key has {s.max_sessions} open sessions, the most tinker.max_sessions allows; "
            "close some (ServiceClient.close) or let them expire"
        )
    return {
        "type": "create_session",
        "session_id": registry.open_session(tenant, metadata, name).session_id,
    }


@router.post(f"{API}/session_heartbeat")
async def heartbeat(request: Request, state: State, tenant: Tenant) -> Any:
    body = await body_of(request)
    try:
        state.registry.session(tenant, params.text(body, "session_id"))
    except Unknown as exc:
        return problem(410, exc.message, "session_id")  # the SDK stops heartbeating
    return {}


@router.post(f"{API}/telemetry")
async def telemetry(request: Request) -> dict[str, Any]:
    await drain(request)
    return {"status": "accepted"}


@router.post(f"{API}/sessions/{{session_id}}/finish")
async def finish(session_id: str, request: Request, state: State, tenant: Tenant) -> dict[str, Any]:
    await drain(request)
    state.end_session(tenant, session_id, "finished by its client")
    return {}
