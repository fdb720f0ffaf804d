"""The Tinker routes of a training client's model: created, described and unloaded; trained by
forward/backward (a protobuf body, capped in scored tokens and top-k width) and optimizer steps.
Each checks its fields here and queues its operation in the model's session lane."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from miles_multilora.http_serving import HTTPProblem, read_body
from miles_multilora.tinker import params, rest_routes
from miles_multilora.tinker.registry import Unknown
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.route_kit import API, State, Tenant, adamw_only, body_of, lane, submit
from miles_multilora.tinker.state import encoder
from miles_multilora.tinker.wire import decode_forward_backward

FLAGS = ("attn", "mlp", "unembed")  # lora_config.train_<family>: the SDK's module families

router = APIRouter()


@router.post(f"{API}/create_model")
async def create_model(request: Request, state: State, tenant: Tenant) -> Any:
    body, s = await body_of(request), state.settings
    session = state.registry.session(tenant, params.text(body, "session_id"))
    seq = params.integer(body, "model_seq_id", low=0)
    lora = params.mapping(body, "lora_config")
    rank = params.integer(lora, "rank", 32, where="lora_config.rank")
    seed = params.integer(lora, "seed", None, low=0, high=2**62, where="lora_config.seed")
    if seed is None:  # the SDK's None: a random seed (0 is a seed like any other)
        seed = state.unseeded_seed()
    trains = {k: params.flag(lora, f"train_{k}", True, where=f"lora_config.train_{k}") for k in FLAGS}
    targets = state.backend.lora_targets(trains["attn"], trains["mlp"], trains["unembed"], s.unembed_lora)
    base = params.text(body, "base_model", None)
    state.check_context(base)  # a 400 now (another base model fails the request when it runs)
    metadata = rest_routes.user_metadata(body, s)
    adamw_only(body)
    model_id = f"{session.session_id}:train:{seq}"

    def create() -> dict[str, Any]:
        return state.create_model(tenant, session.session_id, model_id, rank, seed, base, metadata, targets)

    key = (tenant, session.session_id, "create_model", seq)
    return {"request_id": submit(state, tenant, key, "json", session.lane, [create], body=body)}


@router.post(f"{API}/get_info")
async def get_info(request: Request, state: State, tenant: Tenant) -> Any:
    body, backend = await body_of(request), state.backend
    owned = state.registry.model(tenant, params.text(body, "model_id"))
    if owned.model_id not in backend.models:  # created, not yet in its slot
        raise Unknown("model_id", f"unknown model {owned.model_id!r}")
    entry = backend.model(owned.model_id)
    # the checkpoint's model_type (llama, qwen3_moe, mixtral, ...); the tiny model is a llama-style GPT
    arch = getattr(getattr(backend.rank, "hf_config", None), "model_type", None) or "llama"
    data = {"arch": arch, "model_name": state.base_model, "tokenizer_id": state.tokenizer_id}
    return {"type": "get_info", "model_id": owned.model_id, "model_data": data, "is_lora": True,
            "lora_rank": entry.rank, "model_name": state.base_model}  # fmt: skip


@router.post(f"{API}/unload_model")
async def unload_model(request: Request, state: State, tenant: Tenant) -> Any:
    body = await body_of(request)
    owned = state.registry.model(tenant, params.text(body, "model_id"))

    def unload() -> dict[str, Any]:
        return state.unload_model(owned)

    return {"request_id": submit(state, tenant, None, "json", lane(owned), [unload])}


@router.post(f"{API}/forward_backward")
async def forward_backward(request: Request, state: State, tenant: Tenant) -> Any:
    s = state.settings
    if request.headers.get("content-encoding", "identity") != "identity":
        raise HTTPProblem(415, "compressed bodies are not enabled (proto_compress_fwdbwd is off)")
    raw = await read_body(request, required="a protobuf ForwardBackwardRequest")
    fb, seq = await run_in_threadpool(decode_forward_backward, raw)
    owned = state.registry.model(tenant, fb.model_id)
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
    await run_in_threadpool(state.backend.check, fb)
    key = (tenant, fb.model_id, "forward" if fb.forward_only else "forward_backward", seq) if seq else None
    rid = state.futures.submit(
        tenant, key, lambda: state.queue.submit_forward_backward(fb, lane(owned), checked=True),
        encoder("forward_backward"), owned.session_id, {"forward_backward_input": raw},
    )  # fmt: skip
    return {"request_id": rid}


@router.post(f"{API}/optim_step")
async def optim_step(request: Request, state: State, tenant: Tenant) -> Any:
    body = await body_of(request)
    owned = state.registry.model(tenant, params.text(body, "model_id"))
    adam = params.adam(body)
    seq = params.integer(body, "seq_id", None)

    def step() -> dict[str, Any]:
        return {"metrics": state.backend.optim_step(owned.model_id, **adam)}

    key = (tenant, owned.model_id, "optim_step", seq) if seq is not None else None
    rid = submit(state, tenant, key, "json", lane(owned), [step], body=body, trains=owned.model_id)
    return {"request_id": rid}
