"""The SDK's REST surface (``RestClient``, the ``tinker`` CLI): training runs, checkpoints, weights
info, sessions, ``copy_weights``, ``save_weights_external`` and its signed download URLs; the
SDK calls not served (session search, trace export, projects, audit log and billing) answer a 400
naming them.

Everything answers the caller's tenant only: another tenant's run, checkpoint or session is a 404
exactly like a missing one (:class:`~miles_multilora.tinker.registry.Unknown`). A published
checkpoint is readable by other tenants by its path (training states through ``load``, sampler
weights through ``create_sampling_client``, and ``weights_info``), never listed or downloaded by them. :func:`register` adds the routes to :mod:`.server`'s app.

Download URLs (``get_external_weights_urls``) carry an HMAC-signed token (tenant, checkpoint, file,
expiry; the key is drawn at each server start), so a plain GET without the API key fetches the file,
as the SDK's CLI does, and nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from miles_multilora.config.lora_targets import FAMILIES
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.http_serving import HTTPProblem, read_body
from miles_multilora.tinker import age_export, params
from miles_multilora.tinker.catalog import (
    CHECKPOINT_TYPES,
    EXTERNAL,
    SAMPLER,
    TRAINING,
    CheckpointRecord,
    RunRecord,
)
from miles_multilora.tinker.registry import Unknown
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.route_kit import API
from miles_multilora.tinker.state import PATH, ServerState, checked_name, encoder

DOWNLOAD = f"{API}/checkpoint_files"
OPEN_PATHS = (DOWNLOAD,)  # no API key: the signed token is the credential
_SCOPES = ("owned", "accessible")
PROJECT = "default"  # each API key's one namespace: the only project id accepted
ACCESS_TOKEN_HEADER = "x-tinker-weights-access-token"
NO_ACCESS_TOKENS = (
    "weights access tokens are not served; the checkpoint's owner publishes it "
    "(RestClient.publish_checkpoint_from_tinker_path) and any API key may then read it by its path"
)


# ---------------------------------------------------------------------------- checked inputs
def user_metadata(
    body: dict[str, Any], settings: TinkerConfig, key: str = "user_metadata"
) -> dict[str, str] | None:
    """``user_metadata``: a JSON object of strings, at most ``tinker.max_user_metadata_bytes``."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TinkerError(key, f"must be an object of strings, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise TinkerError(f"{key}.{k}", f"must be a string, got {type(v).__name__}")
    size = len(json.dumps(value).encode())
    if size > settings.max_user_metadata_bytes:
        raise TinkerError(
            key,
            f"is {size} bytes as JSON, over tinker.max_user_metadata_bytes ({settings.max_user_metadata_bytes})",
        )
    return value


def project(body: dict[str, Any], key: str = "project_id") -> None:
    """A project id: this server has one project per API key, :data:`PROJECT` (None means it too)."""
    value = body.get(key)
    if value is not None and value != PROJECT:
        raise TinkerError(
            key, f"this server has one project per API key, {PROJECT!r}; pass {PROJECT!r} "
            f"(e.g. TINKER_PROJECT_ID={PROJECT}) or leave it unset, got {value!r}",
        )  # fmt: skip


def display_name(body: dict[str, Any], settings: TinkerConfig) -> str | None:
    """A session's ``display_name``: a string, at most ``tinker.max_user_metadata_bytes`` bytes."""
    value = params.text(body, "display_name", None)
    if value is not None and len(value.encode()) > settings.max_user_metadata_bytes:
        raise TinkerError(
            "display_name",
            f"is over tinker.max_user_metadata_bytes ({settings.max_user_metadata_bytes}) bytes",
        )
    return value


def ttl_seconds(body: dict[str, Any], settings: TinkerConfig) -> int | None:
    """``ttl_seconds``: None (never expires) or between the server's shortest and longest TTL."""
    ttl = params.integer(body, "ttl_seconds", None)
    low, high = settings.min_checkpoint_ttl_s, settings.max_checkpoint_ttl_s
    if ttl is not None and not low <= ttl <= high:
        raise TinkerError(
            "ttl_seconds", f"must be between {low} and {high} seconds (tinker.min_checkpoint_ttl_s / "
            f"tinker.max_checkpoint_ttl_s) or None for no expiry; got {ttl}",
        )  # fmt: skip
    return ttl


def _query_int(request: Request, key: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise TinkerError(key, f"must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise TinkerError(key, f"must be in {low}..{high}, got {value}")
    return value


def _page(request: Request, settings: TinkerConfig, default_limit: int) -> tuple[int, int]:
    limit = _query_int(request, "limit", default_limit, 1, settings.max_list_limit)
    return limit, _query_int(request, "offset", 0, 0, 2**62)


def _scope(request: Request) -> None:
    """``access_scope``: ``owned`` and ``accessible`` both mean the caller's own (nothing is shared
    but published checkpoints, which are loaded by path, not listed)."""
    scope = request.query_params.get("access_scope", "owned")
    if scope not in _SCOPES:
        raise TinkerError("access_scope", f"must be one of {list(_SCOPES)}, got {scope!r}")


def _kind(kind: str) -> str:
    if kind not in CHECKPOINT_TYPES:
        raise Unknown("checkpoint_id", f"no checkpoint kind {kind!r}; use one of {sorted(CHECKPOINT_TYPES)}")
    return kind


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat()


# ---------------------------------------------------------------------------- signed download tokens
class Signer:
    """Tokens naming one file of one external checkpoint of one tenant, until an expiry."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    def sign(self, fields: dict[str, Any]) -> str:
        payload = base64.urlsafe_b64encode(json.dumps(fields, sort_keys=True).encode()).decode().rstrip("=")
        return f"{payload}.{self._mac(payload)}"

    def verify(self, token: str, now: float) -> dict[str, Any]:
        payload, _, mac = token.partition(".")  # compared as bytes: a str compare refuses non-ASCII
        if not mac or not hmac.compare_digest(mac.encode(), self._mac(payload).encode()):
            raise HTTPProblem(403, "not a valid download link (ask get_external_weights_urls for new ones)")
        fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        if fields["e"] < now:
            raise HTTPProblem(410, "this download link expired (ask get_external_weights_urls for new ones)")
        return fields


# ---------------------------------------------------------------------------- answers
def register(app: FastAPI, state: ServerState) -> None:
    """Add the REST routes to ``app`` (whose guard leaves :data:`OPEN_PATHS` to their own checks)."""
    s, catalog, registry = state.settings, state.catalog, state.registry
    signer = Signer()

    def tenant_of(request: Request) -> str:
        return request.state.principal

    def checkpoint_json(run: RunRecord, c: CheckpointRecord) -> dict[str, Any]:
        return {
            "checkpoint_id": c.checkpoint_id, "checkpoint_type": CHECKPOINT_TYPES[c.kind],
            "time": _iso(c.created), "tinker_path": run.path(c), "size_bytes": c.size_bytes,
            "public": c.public, "user_metadata": c.user_metadata, "expires_at": _iso(c.expires_at),
        }  # fmt: skip

    def last_request(run: RunRecord) -> float:
        """The run's last request: its live session's last word, else its newest checkpoint."""
        times = [run.created, *(c.created for c in catalog.checkpoints_of(run))]
        owned = registry.models.get(run.model_id)
        session = registry.sessions.get(run.session_id)
        if owned is not None and owned.run_id == run.run_id and session is not None:
            times.append(time.time() - (registry.clock() - session.last_seen))
        return max(times)

    def run_json(run: RunRecord) -> dict[str, Any]:
        mine = sorted(catalog.checkpoints_of(run), key=lambda c: c.created)
        last = {
            kind: next((c for c in reversed(mine) if c.kind == kind), None) for kind in (TRAINING, SAMPLER)
        }
        return {
            "training_run_id": run.run_id, "base_model": run.base_model, "model_owner": run.tenant,
            "is_lora": True, "corrupted": False, "lora_rank": run.lora_rank,
            "last_request_time": _iso(last_request(run)), "user_metadata": run.user_metadata,
            "last_checkpoint": checkpoint_json(run, c) if (c := last[TRAINING]) else None,
            "last_sampler_checkpoint": checkpoint_json(run, c) if (c := last[SAMPLER]) else None,
        }  # fmt: skip

    # ---------------------------------------------------------------- training runs
    @app.get(f"{API}/training_runs")
    async def list_training_runs(request: Request) -> dict[str, Any]:
        _scope(request)
        project(dict(request.query_params))
        limit, offset = _page(request, s, 20)
        runs = catalog.runs(tenant_of(request))
        return {
            "training_runs": [run_json(r) for r in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
        _scope(request)
        return run_json(catalog.run(tenant_of(request), run_id))

    # ---------------------------------------------------------------- checkpoints
    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        run = catalog.run(tenant_of(request), run_id)
        mine = sorted(catalog.checkpoints_of(run), key=lambda c: -c.created)
        return {"checkpoints": [checkpoint_json(run, c) for c in mine], "cursor": None}

    @app.get(f"{API}/checkpoints")
    async def list_user_checkpoints(request: Request) -> dict[str, Any]:
        limit, offset = _page(request, s, 100)
        found = catalog.checkpoints(tenant_of(request))
        return {
            "checkpoints": [checkpoint_json(r, c) for r, c in found[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
            "usage": catalog.usage(tenant_of(request)),  # against the key's quotas (0: no limit)
        }

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
        state.delete_checkpoint(tenant_of(request), run_id, _kind(kind), name)
        return Response(status_code=204)

    @app.post(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request) -> Response:
        catalog.set_public(tenant_of(request), run_id, _kind(kind), name, True)
        return Response(status_code=204)

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request) -> Response:
        catalog.set_public(tenant_of(request), run_id, _kind(kind), name, False)
        return Response(status_code=204)

    @app.put(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request) -> Response:
        body = params.json_body(await read_body(request, required='{"ttl_seconds": ...}'))
        catalog.set_ttl(tenant_of(request), run_id, _kind(kind), name, ttl_seconds(body, s))
        return Response(status_code=204)

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        body = params.json_body(await read_body(request, required='{"tinker_path": ...}'))
        path = params.text(body, "tinker_path")
        run_id, kind, name = _parts(path)
        try:
            run, _ = catalog.checkpoint(tenant_of(request), run_id, kind, name)
        except Unknown:
            public = catalog.published(run_id, kind, name)
            if public is None:
                raise Unknown("tinker_path", f"no checkpoint {path}") from None
            run = public[0]
        trains = {}
        if run.lora_targets is not None:  # the SDK's train_* flags of the run's model
            trains = {f"train_{family}": family in run.lora_targets for family in FAMILIES}
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.lora_rank, **trains}

    # ---------------------------------------------------------------- copies
    @app.post(f"{API}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        body = params.json_body(await read_body(request, required='{"source_path": ...}'))
        source = params.text(body, "source_path")
        project(body, "destination_project_id")
        if body.get("session_id") is not None or body.get("model_seq_id") is not None:
            raise TinkerError(
                "session_id", "copies go to the caller's namespace (destination_project_id "
                f"{PROJECT!r}), not into a session; leave session_id and model_seq_id unset",
            )  # fmt: skip
        if body.get("weights_access_token") or request.headers.get(ACCESS_TOKEN_HEADER):
            raise TinkerError("weights_access_token", NO_ACCESS_TOKENS)
        ttl = ttl_seconds(body, s)
        key = request.headers.get("x-idempotency-key") or None
        path = await run_in_threadpool(state.copy_weights, tenant_of(request), source, ttl, key)
        return {"tinker_path": path}

    # ---------------------------------------------------------------- not served
    def not_served(what: str, instead: str) -> Callable[..., Any]:
        async def refuse(request: Request) -> None:
            raise TinkerError(what, f"{what} is not served by this server; {instead}")

        return refuse

    app.post(f"{API}/sessions/search")(
        not_served("search_sessions", "list them with RestClient.list_sessions / get_session")
    )
    app.get(f"{API}/sessions/{{session_id}}/trace_export")(
        not_served("export_session_trace", "there are no session traces to export")
    )
    app.put(f"{API}/sessions/{{session_id}}/project")(
        not_served("assign_session_project", f"this server has one project per API key, {PROJECT!r}")
    )
    # the organization-admin calls (RestClient's deprecated ones and AdminClient's): no billing here
    app.get(f"{API}/audit")(not_served("get_audit_log", "it keeps no audit log"))
    app.get(f"{API}/billing/usage/events")(not_served("get_billing_usage", "it does no billing"))
    app.get(f"{API}/billing/usage/checkpoints/current")(
        not_served(
            "get_current_checkpoint_storage_usage",
            "RestClient.list_user_checkpoints lists each checkpoint with its size_bytes",
        )
    )

    # ---------------------------------------------------------------- external weights (PEFT)
    @app.post(f"{API}/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        body = params.json_body(await read_body(request, required="a JSON object"))
        tenant = tenant_of(request)
        owned = registry.model(tenant, params.text(body, "model_id"))
        name = checked_name(params.text(body, "path"))
        ttl = ttl_seconds(body, s)
        to = age_export.recipients(body, s.max_age_recipients)
        seq = params.integer(body, "seq_id", None)

        def export() -> dict[str, Any]:
            return state.save_external(tenant, owned, name, ttl, to)

        key = (tenant, owned.model_id, "save_weights_external", seq) if seq is not None else None
        lane = (owned.tenant, owned.session_id)
        rid = state.futures.submit(
            tenant,
            key,
            lambda: state.queue.submit_calls(lane, [export]),
            encoder("json"),
            owned.session_id,
            body,
        )
        return {"request_id": rid}

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        catalog.checkpoint(tenant, run_id, _kind(kind), name)
        if kind != EXTERNAL:
            raise TinkerError("checkpoint_id", "only external_weights checkpoints have download URLs")
        root = catalog.files_of(tenant, run_id, kind, name)
        expires = time.time() + s.download_url_ttl_s
        base = str(request.base_url).rstrip("/")
        urls = {}
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = f.relative_to(root).as_posix()
            token = signer.sign({"t": tenant, "r": run_id, "n": name, "f": rel, "e": expires})
            urls[rel] = f"{base}{DOWNLOAD}?token={token}"
        return {"urls": urls, "expires": _iso(expires)}

    @app.get(DOWNLOAD)
    async def download(request: Request) -> Response:
        fields = signer.verify(request.query_params.get("token", ""), time.time())
        tenant, run_id, name, rel = fields["t"], fields["r"], fields["n"], fields["f"]
        catalog.checkpoint(tenant, run_id, EXTERNAL, name)  # deleted since: 404
        root = catalog.files_of(tenant, run_id, EXTERNAL, name)
        target = (root / rel).resolve()
        if not target.is_relative_to(root.resolve()) or not target.is_file():
            raise Unknown("token", f"no file {rel!r} in tinker://{run_id}/{EXTERNAL}/{name}")
        return FileResponse(target, media_type="application/octet-stream")

    # ---------------------------------------------------------------- sessions
    @app.get(f"{API}/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        _scope(request)
        limit, offset = _page(request, s, 20)
        ids = [x.session_id for x in reversed(registry.tenant_sessions(tenant_of(request)))]
        return {"sessions": ids[offset : offset + limit]}

    @app.get(f"{API}/sessions/{{session_id}}")
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        _scope(request)
        tenant = tenant_of(request)
        session = registry.session(tenant, session_id, touch=False)
        runs = [r.run_id for r in reversed(catalog.runs(tenant)) if r.session_id == session_id]
        return {"training_run_ids": runs, "sampler_ids": sorted(session.samplers),
                "user_metadata": session.user_metadata, "display_name": session.display_name}  # fmt: skip


def _parts(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<kind>/<name>`` as its three parts (any of the three kinds)."""
    if match := PATH.match(path):
        return match.group(1), match.group(2), match.group(3)
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != EXTERNAL:
        raise TinkerError(
            "tinker_path",
            f"expected tinker://<run>/<weights|sampler_weights|external_weights>/<name>, got {path!r}",
        )
    return parts[0], parts[1], checked_name(parts[2])
