"""Plain data passed to and from a rollout engine: requests, results and adapter versions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from miles_multilora.config.adapter import SamplingSpec

BASE_ADAPTER = "<base>"
"""Adapter name of base-model requests (slot -1). It cannot collide with a user adapter name."""
BASE_SLOT = -1

FinishReason = Literal["stop", "length", "eos"]


@dataclass(frozen=True)
class AdapterVersion:
    """Where an adapter lives in an engine: its resident slot, its weights version and, for remote
    engines, the directory of its PEFT export for that version."""

    slot: int
    version: int
    path: str | None = None


@dataclass
class GenerationRequest:
    """One completion to generate for one adapter (or the base model when ``slot == -1``)."""

    adapter: str
    slot: int
    version: int
    prompt_ids: list[int]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)  # free: prompt uid, group index, ...

    @classmethod
    def for_base(
        cls, prompt_ids: list[int], sampling: SamplingSpec | None = None, seed: int = 0, **metadata: Any
    ) -> GenerationRequest:
        """A request served by the base model alone (slot -1), e.g. for reference samples."""
        return cls(BASE_ADAPTER, BASE_SLOT, 0, list(prompt_ids), sampling or SamplingSpec(), seed, metadata)


@dataclass
class GenerationResult:
    """A completion, tagged with the (adapter, version) that produced it.

    ``logprobs[i]`` is ``log_softmax(logits / T)[output_ids[i]]`` over the full, untruncated
    distribution, whatever top-k / top-p filtering was used to sample; ``temperature`` is the request's
    sampling temperature (0 = greedy), and ``T`` its
    :func:`~miles_multilora.scoring.temperature.effective_temperature` (1 for greedy): a trainer
    scores the tokens at the result's own temperature, never reading the adapter's spec again.
    ``finish_reason``: ``"eos"`` (the EOS token, kept as the last output token), ``"stop"`` (a stop
    string appeared in the decoded output, special tokens skipped; generation ends with the token that
    completed it, and ``text`` keeps the stop string) or ``"length"`` (max_new_tokens or the context
    window). ``text`` is the decoded output (special tokens skipped), ``None`` without a tokenizer.
    ``token_versions[i]`` is the adapter version whose weights sampled ``output_ids[i]`` (an engine
    that keeps decoding across optimizer steps mixes versions; ``None``: all are ``version``).
    """

    adapter: str
    version: int
    slot: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str | None = None
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    token_versions: list[int] | None = None
    temperature: float = 1.0

    def versions(self) -> list[int]:
        """The version that sampled each output token."""
        if self.token_versions is None:
            return [self.version] * len(self.output_ids)
        return list(self.token_versions)

    @property
    def tag(self) -> tuple[str, int]:
        """The ``(adapter, version)`` pair that produced this sample."""
        return (self.adapter, self.version)
