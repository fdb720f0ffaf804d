"""Custom reward functions for the tiny-model end-to-end tests (``module:function`` rewards).

A random tiny model can learn these in a few steps, so the tests see rewards rise quickly.
"""

from __future__ import annotations

from typing import Any


def fraction_of_letter_a(prompt: str, completion: str, answer: Any, metadata: dict[str, Any]) -> float:
    """Share of the completion's characters that are the letter ``a``."""
    return completion.count("a") / max(len(completion), 1)


def fraction_of_digits(
    prompts: list[str], completions: list[str], answers: list[Any], metadatas: list[dict[str, Any]]
) -> list[float]:
    """Batched: share of each completion's characters that are digits."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
