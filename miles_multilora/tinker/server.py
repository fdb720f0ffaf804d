"""The Tinker REST protocol (as the pinned ``tinker`` SDK speaks it) in front of the backend.

Every operation is queued on the :class:`BatchingQueue` (one thread, arrival order) and answered
with a request id; ``retrieve_future`` long-polls for the result: JSON for most operations,
protobuf for forward/backward and sampling. Models are named ``{session}:train:{seq}`` and
samplers ``{session}:sample:{seq}`` as the SDK expects. Saved states live under ``state_dir`` and
are addressed as ``tinker://{model}/weights/{name}``; a sampler serves a model's live slot at the
version it was saved for (no export). Safety: an API key (when set) is compared in constant time;
bodies over ``max_body_bytes`` are refused; no pickle anywhere (protobuf, JSON, ``torch.load``
with ``weights_only``).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.errors import SpecError
from miles_multilora.tinker.backend import BatchingQueue, TinkerBackend, TinkerError
from miles_multilora.tinker.futures import FutureStore
from miles_multilora.tinker.wire import (
    PROTOBUF,
    decode_forward_backward,
    encode_forward_backward,
    encode_samples,
)

API = "/api/v1"
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
DEFAULT_MAX_TOKENS = 128


@dataclass
class Sampler:
    sampler_id: str
    model_id: str | None  # None: the base model
    version: int | None
    model_path: str | None = None


@dataclass
class ServerState:
    backend: TinkerBackend
    queue: BatchingQueue
    base_model: str
    state_dir: Path
    tokenizer_id: str | None = None
    futures: FutureStore = field(default_factory=FutureStore)
    sessions: dict[str, set[str]] = field(default_factory=dict)  # session -> its model ids
    samplers: dict[str, Sampler] = field(default_factory=dict)
    sampler_weights: dict[str, tuple[str, int]] = field(
        default_factory=dict
    )  # tinker path -> (model, version)


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _weights_file(state: ServerState, path: str) -> Path:
    match = re.fullmatch(r"tinker://([^/]+)/weights/([^/]+)", path or "")
    if not match or not NAME.match(match.group(2)):
        raise TinkerError("path", f"expected tinker://<model>/weights/<name>, got {path!r}")
    run, name = match.groups()
    return state.state_dir / "weights" / re.sub(r"[^A-Za-z0-9_.-]", "_", run) / f"{name}.pt"


def create_app(
    state: ServerState, *, api_key: str | None = None, max_body_bytes: int = 64 * 2**20, poll_s: float = 25.0
) -> FastAPI:
    app = FastAPI(title="miles_multilora tinker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinker = state

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if api_key is not None:
            given = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return _error(401, "missing or wrong X-API-Key")
        length = request.headers.get("content-length")
        if length is not None and int(length) > max_body_bytes:
            return _error(413, f"request body over {max_body_bytes} bytes")
        return await call_next(request)

    def submit(kind: str, key: Any, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {
            "request_id": state.futures.submit(key, kind, lambda: state.queue.submit(fn, *args, **kwargs))
        }

    # ---------------------------------------------------------------- client and session
    @app.post(f"{API}/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False}

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        model = {"model_name": state.base_model, "max_context_length": state.backend.worker.max_seq_len}
        return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}

    @app.post(f"{API}/create_session")
    async def create_session() -> dict[str, Any]:
        session = f"sess-{secrets.token_hex(4)}"
        state.sessions[session] = set()
        return {"type": "create_session", "session_id": session}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(body: dict[str, Any]) -> Any:
        if body.get("session_id") not in state.sessions:
            return _error(410, "session finished")
        return {}

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        for model_id in state.sessions.pop(session_id, set()):  # free the session's slots
            state.queue.submit(_unload_if_loaded, state, model_id)
        for sid in [s for s in state.samplers if s.startswith(f"{session_id}:")]:
            del state.samplers[sid]
        return {}

    # ---------------------------------------------------------------- models
    @app.post(f"{API}/create_model")
    async def create_model(body: dict[str, Any]) -> Any:
        session, seq = body.get("session_id"), body.get("model_seq_id")
        if session not in state.sessions:
            return _error(404, f"unknown session {session!r}")
        model_id = f"{session}:train:{seq}"
        lora = body.get("lora_config") or {}
        base = body.get("base_model")

        def create() -> dict[str, Any]:
            if base not in (None, state.base_model):
                raise TinkerError("base_model", f"this server trains {state.base_model!r}, not {base!r}")
            state.backend.create_model(model_id, int(lora.get("rank", 32)), int(lora.get("seed") or 0))
            state.sessions.setdefault(session, set()).add(model_id)
            return {"type": "create_model", "model_id": model_id}

        return submit("json", ("create", session, seq), create)

    @app.post(f"{API}/get_info")
    async def get_info(body: dict[str, Any]) -> Any:
        entry = state.backend.models.get(body.get("model_id", ""))
        if entry is None:
            return _error(404, f"unknown model {body.get('model_id')!r}")
        data = {"arch": "llama", "model_name": state.base_model, "tokenizer_id": state.tokenizer_id}
        return {"type": "get_info", "model_id": entry.model_id, "model_data": data, "is_lora": True,
                "lora_rank": entry.rank, "model_name": state.base_model}  # fmt: skip

    @app.post(f"{API}/unload_model")
    async def unload_model(body: dict[str, Any]) -> Any:
        model_id = body.get("model_id", "")

        def unload() -> dict[str, Any]:
            state.backend.unload_model(model_id)
            for models in state.sessions.values():
                models.discard(model_id)
            return {"type": "unload_model", "model_id": model_id}

        return submit("json", ("unload", model_id), unload)

    # ---------------------------------------------------------------- training
    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> Any:
        if request.headers.get("content-encoding", "identity") != "identity":
            return _error(415, "compressed bodies are not enabled (proto_compress_fwdbwd is off)")
        try:
            fb, seq = decode_forward_backward(await request.body())
        except SpecError as exc:
            return _error(400, str(exc))
        key = (fb.model_id, seq) if seq is not None else None
        return {
            "request_id": state.futures.submit(
                key, "forward_backward", lambda: state.queue.submit_forward_backward(fb)
            )
        }

    @app.post(f"{API}/optim_step")
    async def optim_step(body: dict[str, Any]) -> Any:
        adam = body.get("adam_params")
        if not isinstance(adam, dict):
            return _error(400, "optim_step needs adam_params (only AdamW is supported)")
        model_id = body.get("model_id", "")

        def step() -> dict[str, Any]:
            return {"metrics": state.backend.optim_step(
                model_id, lr=float(adam["learning_rate"]), beta1=float(adam.get("beta1", 0.9)),
                beta2=float(adam.get("beta2", 0.95)), eps=float(adam.get("eps", 1e-12)),
                weight_decay=float(adam.get("weight_decay", 0.0)), grad_clip_norm=float(adam.get("grad_clip_norm", 0.0)),
            )}  # fmt: skip

        return submit("json", (model_id, body.get("seq_id")), step)

    @app.post(f"{API}/save_weights")
    async def save_weights(body: dict[str, Any]) -> Any:
        model_id, name = body.get("model_id", ""), str(body.get("path", ""))
        path = f"tinker://{model_id}/weights/{name}"

        def save() -> dict[str, Any]:
            target = _weights_file(state, path)
            if target.exists() and not body.get("overwrite"):
                raise TinkerError("path", f"{path} exists; pass overwrite=True or choose another name")
            state.backend.save_state(model_id, target)
            return {"type": "save_weights", "path": path}

        return submit("json", (model_id, body.get("seq_id")), save)

    @app.post(f"{API}/load_weights")
    async def load_weights(body: dict[str, Any]) -> Any:
        path, with_optimizer = str(body.get("path", "")), bool(body.get("optimizer"))
        if body.get("model_id"):
            model_id, key = body["model_id"], (body["model_id"], body.get("seq_id"))
        else:  # create-via-load: the SDK names the new model itself
            session = body.get("session_id")
            if session not in state.sessions:
                return _error(404, f"unknown session {session!r}")
            model_id, key = (
                f"{session}:train:{body.get('model_seq_id')}",
                ("create", session, body.get("model_seq_id")),
            )

        def load() -> dict[str, Any]:
            target = _weights_file(state, path)
            if not target.is_file():
                raise TinkerError("path", f"no saved state at {path}")
            if model_id not in state.backend.models:
                meta = torch.load(target, weights_only=True)["meta"]
                state.backend.create_model(model_id, int(meta["rank"]), int(meta["seed"]))
                state.sessions.setdefault(body.get("session_id", ""), set()).add(model_id)
            state.backend.load_state(model_id, target, optimizer=with_optimizer)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return submit("json", key, load)

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_for_sampler(body: dict[str, Any]) -> Any:
        model_id = body.get("model_id", "")
        session = model_id.split(":train:")[0]

        def snapshot() -> dict[str, Any]:
            version = state.backend.model(model_id).steps
            if body.get("path"):
                name = str(body["path"])
                if not NAME.match(name):
                    raise TinkerError("path", f"names are letters, digits, '_', '-', '.'; got {name!r}")
                path = f"tinker://{model_id}/sampler_weights/{name}"
                state.sampler_weights[path] = (model_id, version)
                return {"type": "save_weights_for_sampler", "path": path}
            sid = f"{session}:sample:{body.get('sampling_session_seq_id')}"
            state.samplers[sid] = Sampler(sid, model_id, version)
            return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sid}

        return submit("json", (model_id, body.get("seq_id")), snapshot)

    # ---------------------------------------------------------------- sampling
    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(body: dict[str, Any]) -> Any:
        session = body.get("session_id")
        if session not in state.sessions:
            return _error(404, f"unknown session {session!r}")
        sid = f"{session}:sample:{body.get('sampling_session_seq_id')}"
        path = body.get("model_path")
        if path:
            if path not in state.sampler_weights:
                return _error(400, f"no sampler weights at {path!r} (save_weights_for_sampler first)")
            model_id, version = state.sampler_weights[path]
            state.samplers[sid] = Sampler(sid, model_id, version, path)
        else:
            base = body.get("base_model")
            if base not in (None, state.base_model):
                return _error(400, f"this server serves {state.base_model!r}, not {base!r}")
            state.samplers[sid] = Sampler(sid, None, None)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> Any:
        s = state.samplers.get(sampler_id)
        if s is None:
            return _error(404, f"unknown sampler {sampler_id!r}")
        return {"sampler_id": s.sampler_id, "base_model": state.base_model, "model_path": s.model_path}

    @app.post(f"{API}/asample")
    async def asample(body: dict[str, Any]) -> Any:
        sampler = state.samplers.get(body.get("sampling_session_id", ""))
        if sampler is None:
            return _error(400, f"unknown sampling session {body.get('sampling_session_id')!r}")
        try:
            prompt, n, spec, seed = _sample_args(body)
        except SpecError as exc:
            return _error(400, str(exc))

        def sample() -> Any:
            if sampler.model_id is not None:
                live = state.backend.model(sampler.model_id).steps
                if live != sampler.version:
                    raise TinkerError(
                        "sampler", f"the sampler serves version {sampler.version} of {sampler.model_id}, whose "
                        f"slot now holds version {live}; save_weights_for_sampler again for the current weights",
                    )  # fmt: skip
            return state.backend.sample(sampler.model_id, prompt, n, spec, seed)

        key = (sampler.sampler_id, body.get("seq_id"))
        rid = state.futures.submit(key, "sample", lambda: state.queue.submit(sample))
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{j}" for j in range(n)]}

    # ---------------------------------------------------------------- futures
    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(body: dict[str, Any]) -> Any:
        rid = body.get("request_id", "")
        pending = state.futures.get(rid)
        if pending is None:
            return _error(404, f"unknown request_id {rid!r}")
        try:
            result = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(pending.future)), timeout=poll_s
            )
        except TimeoutError:
            return JSONResponse(
                {"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408
            )
        except SpecError as exc:
            return {"error": str(exc), "category": "user"}
        except Exception as exc:  # noqa: BLE001 - reported to the client
            return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
        if pending.kind == "forward_backward":
            return Response(encode_forward_backward(result), media_type=PROTOBUF)
        if pending.kind == "sample":
            return Response(encode_samples(result), media_type=PROTOBUF)
        return result

    return app


def _unload_if_loaded(state: ServerState, model_id: str) -> None:
    if model_id in state.backend.models:
        state.backend.unload_model(model_id)


def _sample_args(body: dict[str, Any]) -> tuple[list[int], int, SamplingSpec, int]:
    tokens: list[int] = []
    for chunk in (body.get("prompt") or {}).get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise TinkerError("prompt", "only encoded_text prompt chunks are supported")
        tokens.extend(int(t) for t in chunk.get("tokens") or [])
    if not tokens:
        raise TinkerError("prompt", "the prompt has no tokens")
    params = body.get("sampling_params") or {}
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop and not all(isinstance(s, str) for s in stop):
        raise TinkerError("sampling_params.stop", "stop token ids are not supported; pass stop strings")
    spec = SamplingSpec(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=int(params.get("top_k", -1)),
        max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
        stop=list(stop or []),
    )
    n = int(body.get("num_samples", 1))
    if not 1 <= n <= 1024:
        raise TinkerError("num_samples", "must be in 1..1024")
    return tokens, n, spec, int(params.get("seed") or time.time_ns() % 2**31)
