"""The Tinker routes of sampling: a sampling session made (of saved sampler weights or the base
model), described, and sampled from (its prompt optionally scored)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from miles_multilora.tinker import params
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.route_kit import API, State, Tenant, body_of, submit

router = APIRouter()


@router.post(f"{API}/create_sampling_session")
async def create_sampling_session(request: Request, state: State, tenant: Tenant) -> Any:
    body = await body_of(request)
    session = state.registry.session(tenant, params.text(body, "session_id"))
    sampler_id = f"{session.session_id}:sample:{params.integer(body, 'sampling_session_seq_id', low=0)}"
    path = params.text(body, "model_path", None)
    base = None if path else params.text(body, "base_model", None)
    state.open_sampler(tenant, session.session_id, sampler_id, path, base)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get(f"{API}/samplers/{{sampler_id}}")
async def get_sampler(sampler_id: str, state: State, tenant: Tenant) -> Any:
    sampler = state.registry.sampler(tenant, sampler_id)
    return {
        "sampler_id": sampler.sampler_id,
        "base_model": state.base_model,
        "model_path": sampler.model_path,
    }


@router.post(f"{API}/asample")
async def asample(request: Request, state: State, tenant: Tenant) -> Any:
    body = await body_of(request)
    sampler = state.registry.sampler(tenant, params.text(body, "sampling_session_id"))
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
    scoring = params.prompt_scoring(body, state.settings, spec.temperature, seed)
    sample_topk = params.sample_topk(body, state.settings)
    seq = params.integer(body, "seq_id", None)
    calls, costs, combine = await run_in_threadpool(
        state.sample_parts, sampler, prompt, n, spec, seed, scoring, sample_topk
    )
    key = (tenant, sampler.sampler_id, "sample", seq) if seq is not None else None
    lane = (tenant, sampler.session_id)
    rid = submit(state, tenant, key, "sample", lane, calls, combine=combine, costs=costs, body=body)
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{j}" for j in range(n)]}
