"""Plain records passed between the data source, the rollout and the rewards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DatasetRow:
    """One dataset example in a uniform shape, whatever the source.

    ``prompt``: the question text (before the prompt template); ``answer``: the reference answer
    (``None`` when the dataset has none); ``metadata``: what a reward may need (the row's other
    fields; for reasoning-gym the full entry under ``"entry"``); ``fields``: every field of the
    row, for the prompt template.
    """

    prompt: str
    answer: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptItem:
    """A prompt drawn for one adapter: rendered prompt text plus what its reward needs.

    ``index`` is the row index in the adapter's dataset; ``uid`` (``name:epoch:position``) is
    unique per adapter over the whole run.
    """

    adapter: str
    index: int
    uid: str
    epoch: int
    prompt: str
    answer: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    question: str = ""  # the raw question text, before template / chat template


@dataclass
class RewardSample:
    """One completion to score. ``response_length`` (tokens) enables DAPO overlong shaping."""

    prompt: str
    completion: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response_length: int | None = None
    max_new_tokens: int | None = None  # defaults to the adapter's sampling.max_new_tokens

    @classmethod
    def from_item(cls, item: PromptItem, completion: str, response_length: int | None = None) -> RewardSample:
        """The sample for ``completion`` generated from ``item``."""
        return cls(
            prompt=item.prompt,
            completion=completion,
            answer=item.answer,
            metadata=item.metadata,
            response_length=response_length,
        )
