"""Rollout engines: the interface, the embedded engine (default) and the SGLang and vLLM HTTP engines.

The Megatron-backed engine (``EmbeddedEngine``) is imported on first use, so an HTTP-only client does
not import Megatron. Logprobs of given sequences are :mod:`miles_multilora.scoring`'s.
"""

from typing import Any

from miles_multilora.rollout.adapter_versions import lora_name
from miles_multilora.rollout.engine import RolloutEngine, RolloutError
from miles_multilora.rollout.sglang_engine import SGLangEngine
from miles_multilora.rollout.types import (
    BASE_ADAPTER,
    BASE_SLOT,
    AdapterVersion,
    GenerationRequest,
    GenerationResult,
)
from miles_multilora.rollout.vllm_engine import VLLMEngine

_LAZY = {
    "EmbeddedEngine": "miles_multilora.rollout.embedded",
}

__all__ = [
    "BASE_ADAPTER",
    "BASE_SLOT",
    "AdapterVersion",
    "EmbeddedEngine",
    "GenerationRequest",
    "GenerationResult",
    "RolloutEngine",
    "RolloutError",
    "SGLangEngine",
    "VLLMEngine",
    "lora_name",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
