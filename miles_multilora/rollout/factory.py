"""Build the HTTP rollout engine (``rollout=sglang`` or ``rollout=vllm``) that a run config names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from miles_multilora.rollout.remote_engine import RemoteEngine

if TYPE_CHECKING:
    from miles_multilora.config.sections.rollout import RolloutConfig


def server_urls(value: str | None) -> list[str]:
    """A comma-separated list of server URLs."""
    return [u.strip() for u in str(value or "").split(",") if u.strip()]


def remote_engine(
    rollout: RolloutConfig,
    *,
    manages_adapters: bool,
    first_server: int,
    eos_token_ids: int | Iterable[int] | None,
    export_root: str | None,
) -> RemoteEngine:
    """The SGLang or vLLM client for a validated ``rollout`` config."""
    common: dict[str, Any] = {
        "manages_adapters": manages_adapters,  # one trainer rank loads adapters on the servers
        "first_server": first_server,  # DP ranks start their round-robin at different servers
        "max_versions_per_adapter": rollout.max_versions_per_adapter,
        "export_root": export_root,
    }
    if rollout.engine == "sglang":
        from miles_multilora.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(server_urls(rollout.sglang_url), **common)
    if rollout.engine == "vllm":
        from miles_multilora.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            server_urls(rollout.vllm_url),
            eos_token_ids=eos_token_ids,
            group_samples=rollout.vllm_group_samples,
            logprobs_mode=rollout.vllm_logprobs_mode,
            **common,
        )
    raise ValueError(f"rollout.engine={rollout.engine!r} is not an HTTP engine (sglang or vllm)")
