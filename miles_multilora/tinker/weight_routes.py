"""The Tinker routes that save and load a model's weights: a training state saved (with its
optimizer) or loaded into a model (or into a new one: create-via-load), and sampler weights saved
(under a name, or for a sampling session of their own)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from miles_multilora.tinker import params, rest_routes
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.route_kit import API, State, Tenant, adamw_only, body_of, lane, submit
from miles_multilora.tinker.state import checked_name

router = APIRouter()


@router.post(f"{API}/save_weights")
async def save_weights(request: Request, state: State, tenant: Tenant) -> Any:
    body, s = await body_of(request), state.settings
    owned = state.registry.model(tenant, params.text(body, "model_id"))
    name = checked_name(params.text(body, "path"))
    overwrite, seq = params.flag(body, "overwrite"), params.integer(body, "seq_id", None)
    ttl, metadata = rest_routes.ttl_seconds(body, s), rest_routes.user_metadata(body, s)

    def save() -> dict[str, Any]:
        return state.save_weights(tenant, owned, name, overwrite, ttl, metadata)

    key = (tenant, owned.model_id, "save_weights", seq) if seq is not None else None
    return {"request_id": submit(state, tenant, key, "json", lane(owned), [save], body=body)}


@router.post(f"{API}/load_weights")
async def load_weights(request: Request, state: State, tenant: Tenant) -> Any:
    body, registry = await body_of(request), state.registry
    path = params.text(body, "path")
    state.weights_of(tenant, path)  # a 400 now when it is no path of saved weights
    with_optimizer = params.flag(body, "optimizer")
    metadata = rest_routes.user_metadata(body, state.settings)
    adamw_only(body)
    if body.get("weights_access_token") is not None:
        raise TinkerError("weights_access_token", rest_routes.NO_ACCESS_TOKENS)
    base = params.text(body, "base_model", None)
    state.check_base(base, "trains")
    if body.get("model_id") is not None:
        owned = registry.model(tenant, params.text(body, "model_id"))
        seq = params.integer(body, "seq_id", None)
        key = (tenant, owned.model_id, "load_weights", seq) if seq is not None else None
        model_id, session_id, lane_ = owned.model_id, None, lane(owned)
    else:  # create-via-load: the SDK names the new model itself
        session = registry.session(tenant, params.text(body, "session_id"))
        seq = params.integer(body, "model_seq_id", low=0)
        model_id, session_id, lane_ = f"{session.session_id}:train:{seq}", session.session_id, session.lane
        key = (tenant, session_id, "create_model", seq)

    def load() -> dict[str, Any]:
        return state.load_weights(tenant, path, model_id, with_optimizer, session_id, metadata)

    return {"request_id": submit(state, tenant, key, "json", lane_, [load], body=body)}


@router.post(f"{API}/save_weights_for_sampler")
async def save_for_sampler(request: Request, state: State, tenant: Tenant) -> Any:
    body, s = await body_of(request), state.settings
    owned = state.registry.model(tenant, params.text(body, "model_id"))
    seq = params.integer(body, "seq_id", None)
    name = params.text(body, "path", None)
    ttl, metadata = rest_routes.ttl_seconds(body, s), rest_routes.user_metadata(body, s)
    kind = params.text(body, "kind", "snapshot")
    if kind not in ("snapshot", "inflight"):
        raise TinkerError("kind", f"must be 'snapshot' or 'inflight'; got {kind!r}")
    inflight = kind == "inflight"
    if inflight and name is not None:
        raise TinkerError(
            "path", "an inflight save names no path: it publishes the model's live weights to a new "
            "sampler (save_weights_and_get_sampling_client(kind='inflight'))",
        )  # fmt: skip
    path, sampler_id = None, None
    if name is not None:
        path = f"tinker://{owned.run_id}/sampler_weights/{checked_name(name)}"
    else:
        sampler_seq = params.integer(body, "sampling_session_seq_id", low=0)
        sampler_id = f"{owned.session_id}:sample:{sampler_seq}"

    def snapshot() -> dict[str, Any]:
        return state.save_for_sampler(tenant, owned, path, sampler_id, ttl, metadata, inflight=inflight)

    key = (tenant, owned.model_id, "save_weights_for_sampler", seq) if seq is not None else None
    return {"request_id": submit(state, tenant, key, "json", lane(owned), [snapshot], body=body)}
