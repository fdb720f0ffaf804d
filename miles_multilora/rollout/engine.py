"""The rollout engine interface: generate tagged completions for many adapters at once."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence

from miles_multilora.config.adapter import MAX_INT64, MAX_TOKEN_ID
from miles_multilora.config.strict import shown
from miles_multilora.errors import RolloutError
from miles_multilora.rollout.types import (
    BASE_ADAPTER,
    BASE_SLOT,
    AdapterVersion,
    GenerationRequest,
    GenerationResult,
)

__all__ = ["RolloutEngine", "RolloutError", "unservable_sampling"]


def _integer(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def unservable_sampling(req: GenerationRequest) -> tuple[str, str] | None:
    """``(field, what is wrong)`` when an engine cannot hold ``req``'s sampling values and seed in
    its tensors, else None: finite temperature >= 0 and top_p in (0, 1], integer top_k in
    -1..MAX_TOKEN_ID, max_new_tokens in 1..MAX_TOKEN_ID, seed in 0..2**63 - 1. The doors check more
    (the spec's and the request's bounds); this is the engine's own guard, so that a value that
    slipped past them fails its own request, never a batch."""
    sp = req.sampling
    for key in ("temperature", "top_p"):
        value = getattr(sp, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"sampling.{key}", f"must be a finite number, got {shown(value)}"
    if sp.temperature < 0:
        return "sampling.temperature", f"must be >= 0, got {sp.temperature}"
    if not 0 < sp.top_p <= 1:
        return "sampling.top_p", f"must be in (0, 1], got {sp.top_p}"
    if not _integer(sp.top_k, -1, MAX_TOKEN_ID):
        return "sampling.top_k", f"must be -1 (off) or 0..{MAX_TOKEN_ID}, got {shown(sp.top_k)}"
    if not _integer(sp.max_new_tokens, 1, MAX_TOKEN_ID):
        return "sampling.max_new_tokens", f"must be in 1..{MAX_TOKEN_ID}, got {shown(sp.max_new_tokens)}"
    if not all(_integer(t, 0, MAX_TOKEN_ID) for t in sp.stop_token_ids):
        return "sampling.stop_token_ids", f"must be token ids in 0..{MAX_TOKEN_ID}"
    if not _integer(req.seed, 0, MAX_INT64):
        return "seed", f"must be in 0..{MAX_INT64}, got {shown(req.seed)}"
    return None


class RolloutEngine(ABC):
    """Generates completions, each tagged (adapter, version); knows which adapter versions it serves.

    Subclasses keep ``self._adapters`` (adapter name -> :class:`AdapterVersion`) up to date in
    :meth:`update_adapters` / :meth:`remove_adapters`; :meth:`check_requests` uses it to refuse any
    request whose slot or version does not match what the engine serves, so a sample is never
    produced by the base model or another adapter by mistake.
    """

    streams = False
    """Whether work may stay in the engine across calls (``submit`` / ``run`` / ``take`` /
    ``cancel``; continuous rollout): the embedded engine's stream."""

    def __init__(self) -> None:
        self._adapters: dict[str, AdapterVersion] = {}

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate one result per request, in request order."""

    @abstractmethod
    def update_adapters(self, changed: Mapping[str, AdapterVersion]) -> None:
        """Serve the given adapters at the given versions from now on (only changed ones are passed)."""

    @abstractmethod
    def remove_adapters(self, names: Iterable[str]) -> None:
        """Stop serving these adapters (their slots may be reused)."""

    def step_stats(self) -> dict[str, float]:
        """Counters of the engine since the last call (the worker adds them to the step's metrics)."""
        return {}

    def adapter_versions(self) -> dict[str, int]:
        """Adapter name -> the version this engine currently serves."""
        return {name: av.version for name, av in self._adapters.items()}

    def check_requests(self, requests: Sequence[GenerationRequest]) -> None:
        """Raise :class:`RolloutError` for a request this engine cannot serve exactly as tagged."""
        for i, req in enumerate(requests):
            self.check_request(req, i)

    def check_request(self, req: GenerationRequest, index: int = 0) -> None:
        """Raise :class:`RolloutError` when this engine cannot serve ``req`` exactly as tagged
        (callers use it to fail one adapter's requests before a batch is generated)."""
        i = index
        if not req.prompt_ids:
            raise RolloutError(f"request {i} ({req.adapter!r}): prompt_ids is empty")
        if req.slot == BASE_SLOT or req.adapter == BASE_ADAPTER:
            if req.slot != BASE_SLOT or req.adapter != BASE_ADAPTER:
                raise RolloutError(
                    f"request {i}: base-model requests need adapter={BASE_ADAPTER!r} and slot={BASE_SLOT}, "
                    f"got adapter={req.adapter!r} slot={req.slot}"
                )
        else:
            served = self._adapters.get(req.adapter)
            if served is None:
                raise RolloutError(f"request {i}: adapter {req.adapter!r} is not loaded in this engine")
            if (served.slot, served.version) != (req.slot, req.version):
                raise RolloutError(
                    f"request {i}: adapter {req.adapter!r} asks for slot {req.slot} version {req.version}, "
                    f"but the engine serves slot {served.slot} version {served.version}"
                )
        problem = unservable_sampling(req)
        if problem is not None:
            raise RolloutError(f"request {i} ({req.adapter!r}): {problem[0]} {problem[1]}")

    @staticmethod
    def check_slots(adapters: Mapping[str, AdapterVersion]) -> None:
        """Raise :class:`RolloutError` if two adapters claim the same slot or a slot is negative."""
        owners: dict[int, str] = {}
        for name, av in adapters.items():
            if name == BASE_ADAPTER:
                raise RolloutError(f"{BASE_ADAPTER!r} is reserved for base-model requests")
            if av.slot < 0:
                raise RolloutError(f"adapter {name!r}: slot must be >= 0, got {av.slot}")
            if av.slot in owners:
                raise RolloutError(f"adapters {owners[av.slot]!r} and {name!r} both claim slot {av.slot}")
            owners[av.slot] = name
