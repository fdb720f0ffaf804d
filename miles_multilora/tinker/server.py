"""The Tinker REST protocol (as the pinned ``tinker`` SDK speaks it), over HTTP.

Every route checks its fields (a malformed field is a 400 naming it, ``category: user``; an id the
caller's tenant does not own is a 404 exactly like an unknown one), then queues its operation
(:class:`~miles_multilora.tinker.state.ServerState`) on the
:class:`~miles_multilora.tinker.scheduler.BatchingQueue` in its session's lane and answers with a
request id. ``retrieve_future`` long-polls for the result: JSON for most operations, protobuf for
forward/backward and sampling; a failure is ``{"error", "category"}`` (``user`` for anything the
request itself got wrong, ``server`` otherwise).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.errors import ConfigError
from miles_multilora.http_serving import Guard, HTTPProblem, read_body
from miles_multilora.tinker import params, rest_routes
from miles_multilora.tinker.futures import Busy, Gone
from miles_multilora.tinker.registry import OwnedModel, Unknown
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.scheduler import QueueStopped, Work
from miles_multilora.tinker.state import ServerState, checked_name, encoder
from miles_multilora.tinker.wire import decode_forward_backward

logger = logging.getLogger(__name__)

API = "/api/v1"
FLAGS = ("attn", "mlp", "unembed")  # lora_config.train_<family>: the SDK's module families


# ---------------------------------------------------------------------------- answers
def _problem(
    status: int, detail: str, field_: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"detail": detail, "category": "server" if status >= 500 else "user"}
    if field_ is not None:
        body["field"] = field_
    return JSONResponse(body, status_code=status, headers=headers)


def render(status: int, message: str, type_: str, headers: dict[str, str]) -> JSONResponse:
    """The guard's errors (401, 408, 413, 500) in this door's shape; the connection then closes."""
    return _problem(status, message, headers={"Connection": "close", **headers})


def create_app(
    state: ServerState, *, authenticate: Callable[[Any], str | None], poll_s: float = 25.0
) -> FastAPI:
    """The app: ``authenticate(scope)`` gives the caller's tenant (or None: 401); its HTTP limits
    are ``state.settings``'."""
    app = FastAPI(title="miles_multilora tinker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = state
    app.add_middleware(
        Guard,
        render=render,
        logger=logger,
        limits=HTTPLimits.of(state.settings),
        authenticate=authenticate,
        open_paths=rest_routes.OPEN_PATHS,
        unauthorized=("missing or wrong X-API-Key", "AuthError", {}),
    )
    s = state.settings
    registry, futures, queue, backend = state.registry, state.futures, state.queue, state.backend
    # the checkpoint's model_type (llama, qwen3_moe, mixtral, ...); the tiny model is a llama-style GPT
    arch = getattr(getattr(backend.rank, "hf_config", None), "model_type", None) or "llama"

    @app.exception_handler(HTTPProblem)
    async def _on_problem(request: Request, exc: HTTPProblem) -> JSONResponse:
        return _problem(exc.status, exc.message, exc.field, headers={"Connection": "close"})

    @app.exception_handler(Unknown)
    async def _on_unknown(request: Request, exc: Unknown) -> JSONResponse:
        return _problem(404, exc.message, exc.key)

    @app.exception_handler(ConfigError)  # TinkerError and SpecError (e.g. an unknown loss) included
    async def _on_bad_request(request: Request, exc: ConfigError) -> JSONResponse:
        return _problem(400, str(exc), exc.key)

    @app.exception_handler(QueueStopped)
    async def _on_stopping(request: Request, exc: QueueStopped) -> JSONResponse:
        return _problem(503, str(exc), headers={"Connection": "close"})

    @app.exception_handler(Busy)
    async def _on_busy(request: Request, exc: Busy) -> JSONResponse:
        return _problem(429, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _on_routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _problem(exc.status_code, str(exc.detail), headers=exc.headers)

    async def body_of(request: Request) -> dict[str, Any]:
        return params.json_body(await read_body(request, required="a JSON object"))

    async def drain(request: Request) -> None:
        """Read (and drop) a body this route does not need, within the body limits."""
        try:
            async for _ in request.stream():
                pass
        except ClientDisconnect:
            pass

    def tenant_of(request: Request) -> str:
        return request.state.principal

    def submit(
        tenant: str, key: Any, kind: str, lane: Any, calls: list[Work],
        combine: Callable[[list[Any]], Any] = lambda r: r[0], costs: list[int] | None = None,
    ) -> str:  # fmt: skip
        return futures.submit(
            tenant, key, lambda: queue.submit_calls(lane, calls, combine, costs), encoder(kind), lane[1]
        )

    # ---------------------------------------------------------------- client and session
    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        await drain(request)
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False}

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict[str, Any]:
        await drain(request)
        return {}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        model = {"model_name": state.base_model, "max_context_length": backend.rank.max_seq_len}
        return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        metadata = rest_routes.user_metadata(body, s)
        rest_routes.project(body)
        name = rest_routes.display_name(body, s)
        tenant = tenant_of(request)
        if registry.count_sessions(tenant) >= s.max_sessions:
            raise Busy(
                f"this API key has {s.max_sessions} open sessions, the most tinker.max_sessions allows; "
                "close some (ServiceClient.close) or let them expire"
            )
        return {
            "type": "create_session",
            "session_id": registry.open_session(tenant, metadata, name).session_id,
        }

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        body = await body_of(request)
        try:
            registry.session(tenant_of(request), params.text(body, "session_id"))
        except Unknown as exc:
            return _problem(410, exc.message, "session_id")  # the SDK stops heartbeating
        return {}

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request) -> dict[str, Any]:
        await drain(request)
        return {"status": "accepted"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        await drain(request)
        state.end_session(tenant_of(request), session_id, "finished by its client")
        return {}

    # ---------------------------------------------------------------- models
    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        session = registry.session(tenant, params.text(body, "session_id"))
        seq = params.integer(body, "model_seq_id", low=0)
        lora = params.mapping(body, "lora_config")
        rank = params.integer(lora, "rank", 32, where="lora_config.rank")
        seed = params.integer(lora, "seed", None, low=0, high=2**62, where="lora_config.seed")
        if seed is None:  # the SDK's None: a random seed (0 is a seed like any other)
            seed = state.unseeded_seed()
        trains = {k: params.flag(lora, f"train_{k}", True, where=f"lora_config.train_{k}") for k in FLAGS}
        targets = backend.lora_targets(trains["attn"], trains["mlp"], trains["unembed"], s.unembed_lora)
        base = params.text(body, "base_model", None)
        metadata = rest_routes.user_metadata(body, s)
        adamw_only(body)
        model_id = f"{session.session_id}:train:{seq}"

        def create() -> dict[str, Any]:
            return state.create_model(
                tenant, session.session_id, model_id, rank, seed, base, metadata, targets
            )

        rid = submit(
            tenant, (tenant, session.session_id, "create_model", seq), "json", session.lane, [create]
        )
        return {"request_id": rid}

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> Any:
        body = await body_of(request)
        owned = registry.model(tenant_of(request), params.text(body, "model_id"))
        if owned.model_id not in backend.models:  # created, not yet in its slot
            raise Unknown("model_id", f"unknown model {owned.model_id!r}")
        entry = backend.model(owned.model_id)
        data = {"arch": arch, "model_name": state.base_model, "tokenizer_id": state.tokenizer_id}
        return {"type": "get_info", "model_id": owned.model_id, "model_data": data, "is_lora": True,
                "lora_rank": entry.rank, "model_name": state.base_model}  # fmt: skip

    @app.post(f"{API}/unload_model")
    async def unload_model(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        owned = registry.model(tenant, params.text(body, "model_id"))

        def unload() -> dict[str, Any]:
            return state.unload_model(owned)

        return {"request_id": submit(tenant, None, "json", _lane(owned), [unload])}

    # ---------------------------------------------------------------- training
    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> Any:
        tenant = tenant_of(request)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise HTTPProblem(415, "compressed bodies are not enabled (proto_compress_fwdbwd is off)")
        raw = await read_body(request, required="a protobuf ForwardBackwardRequest")
        fb, seq = await run_in_threadpool(decode_forward_backward, raw)
        owned = registry.model(tenant, fb.model_id)
        widest = max((d.targets_per_token for d in fb.data), default=1)
        if widest > s.max_topk_prompt_logprobs:
            raise TinkerError(
                "data", f"[N, K] target_tokens with K={widest}; the cap is {s.max_topk_prompt_logprobs} "
                "(tinker.max_topk_prompt_logprobs): send fewer targets per position",
            )  # fmt: skip
        tokens = sum(d.scored_tokens for d in fb.data)
        if tokens > s.max_forward_backward_tokens:
            raise TinkerError(
                "data", f"{tokens} scored tokens in one request (input tokens, K each with [N, K] targets); "
                f"the cap is {s.max_forward_backward_tokens} (tinker.max_forward_backward_tokens): send fewer "
                "or shorter datums per call",
            )  # fmt: skip
        await run_in_threadpool(backend.check, fb)
        key = (
            (tenant, fb.model_id, "forward" if fb.forward_only else "forward_backward", seq) if seq else None
        )
        rid = futures.submit(
            tenant, key, lambda: queue.submit_forward_backward(fb, _lane(owned), checked=True),
            encoder("forward_backward"), owned.session_id,
        )  # fmt: skip
        return {"request_id": rid}

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        owned = registry.model(tenant, params.text(body, "model_id"))
        adam = params.adam(body)
        seq = params.integer(body, "seq_id", None)

        def step() -> dict[str, Any]:
            return {"metrics": backend.optim_step(owned.model_id, **adam)}

        key = (tenant, owned.model_id, "optim_step", seq) if seq is not None else None
        return {"request_id": submit(tenant, key, "json", _lane(owned), [step])}

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        owned = registry.model(tenant, params.text(body, "model_id"))
        name = checked_name(params.text(body, "path"))
        overwrite, seq = params.flag(body, "overwrite"), params.integer(body, "seq_id", None)
        ttl, metadata = rest_routes.ttl_seconds(body, s), rest_routes.user_metadata(body, s)

        def save() -> dict[str, Any]:
            return state.save_weights(tenant, owned, name, overwrite, ttl, metadata)

        key = (tenant, owned.model_id, "save_weights", seq) if seq is not None else None
        return {"request_id": submit(tenant, key, "json", _lane(owned), [save])}

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        path = params.text(body, "path")
        state.weights_of(tenant, path)  # a 400 now when it is no path of saved weights
        with_optimizer = params.flag(body, "optimizer")
        metadata = rest_routes.user_metadata(body, s)
        adamw_only(body)
        if body.get("weights_access_token") is not None:
            raise TinkerError("weights_access_token", rest_routes.NO_ACCESS_TOKENS)
        base = params.text(body, "base_model", None)
        if base not in (None, state.base_model):
            raise TinkerError("base_model", f"this server trains {state.base_model!r}, not {base!r}")
        if body.get("model_id") is not None:
            owned = registry.model(tenant, params.text(body, "model_id"))
            seq = params.integer(body, "seq_id", None)
            key = (tenant, owned.model_id, "load_weights", seq) if seq is not None else None
            model_id, session_id, lane = owned.model_id, None, _lane(owned)
        else:  # create-via-load: the SDK names the new model itself
            session = registry.session(tenant, params.text(body, "session_id"))
            seq = params.integer(body, "model_seq_id", low=0)
            model_id, session_id, lane = f"{session.session_id}:train:{seq}", session.session_id, session.lane
            key = (tenant, session_id, "create_model", seq)

        def load() -> dict[str, Any]:
            return state.load_weights(tenant, path, model_id, with_optimizer, session_id, metadata)

        return {"request_id": submit(tenant, key, "json", lane, [load])}

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        owned = registry.model(tenant, params.text(body, "model_id"))
        seq = params.integer(body, "seq_id", None)
        name = params.text(body, "path", None)
        ttl, metadata = rest_routes.ttl_seconds(body, s), rest_routes.user_metadata(body, s)
        kind = params.text(body, "kind", "snapshot")
        if kind != "snapshot":
            raise TinkerError(
                "kind", f"only 'snapshot' samplers are served (they keep the saved version); got {kind!r}"
            )
        path, sampler_id = None, None
        if name is not None:
            path = f"tinker://{owned.run_id}/sampler_weights/{checked_name(name)}"
        else:
            sampler_seq = params.integer(body, "sampling_session_seq_id", low=0)
            sampler_id = f"{owned.session_id}:sample:{sampler_seq}"

        def snapshot() -> dict[str, Any]:
            return state.save_for_sampler(tenant, owned, path, sampler_id, ttl, metadata)

        key = (tenant, owned.model_id, "save_weights_for_sampler", seq) if seq is not None else None
        return {"request_id": submit(tenant, key, "json", _lane(owned), [snapshot])}

    # ---------------------------------------------------------------- sampling
    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        session = registry.session(tenant, params.text(body, "session_id"))
        sampler_id = f"{session.session_id}:sample:{params.integer(body, 'sampling_session_seq_id', low=0)}"
        path = params.text(body, "model_path", None)
        base = None if path else params.text(body, "base_model", None)
        state.open_sampler(tenant, session.session_id, sampler_id, path, base)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> Any:
        sampler = registry.sampler(tenant_of(request), sampler_id)
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": state.base_model,
            "model_path": sampler.model_path,
        }

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> Any:
        body, tenant = await body_of(request), tenant_of(request)
        sampler = registry.sampler(tenant, params.text(body, "sampling_session_id"))
        for key in ("model_path", "base_model"):  # what a sampler samples is chosen when it is made
            if body.get(key) is not None:
                raise TinkerError(
                    key, f"a sample request samples its sampling session's model; leave {key} unset "
                    "(create_sampling_client(model_path=... / base_model=...) chooses it)",
                )  # fmt: skip
        prompt = params.prompt_tokens(body)
        n, spec, seed = params.sampling(body)
        if seed is None:
            seed = state.unseeded_seed()
        scoring = params.prompt_scoring(body, s.max_topk_prompt_logprobs)
        seq = params.integer(body, "seq_id", None)
        calls, costs, combine = await run_in_threadpool(
            state.sample_parts, sampler, prompt, n, spec, seed, scoring
        )
        key = (tenant, sampler.sampler_id, "sample", seq) if seq is not None else None
        rid = submit(tenant, key, "sample", (tenant, sampler.session_id), calls, combine=combine, costs=costs)
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{j}" for j in range(n)]}

    # ---------------------------------------------------------------- futures
    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        body = await body_of(request)
        try:
            entry = futures.get(tenant_of(request), params.text(body, "request_id"))
        except Gone as exc:
            return {"error": exc.message, "category": exc.category}
        ready = asyncio.wrap_future(entry.ready)
        deadline = asyncio.get_running_loop().time() + poll_s
        registry.heard_from(entry.tenant, entry.session_id)  # a client polling keeps its session alive
        while not ready.done():  # in short waits, so that a stopping server lets go of its long polls
            if state.stopping.is_set():
                return _problem(503, "the server is stopping; poll again", headers={"Connection": "close"})
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                try_again = {"type": "try_again", "request_id": entry.request_id, "queue_state": "active"}
                return JSONResponse(try_again, status_code=408)
            await asyncio.wait([ready], timeout=min(remaining, 0.25))
            registry.heard_from(entry.tenant, entry.session_id)
        outcome = ready.result()
        futures.retrieved(entry)
        return Response(outcome.body, media_type=outcome.media_type)

    rest_routes.register(app, state)  # runs, checkpoints, weights info, sessions, external weights
    return app


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


def _lane(owned: OwnedModel) -> tuple[str, str]:
    return (owned.tenant, owned.session_id)
