"""Custom reward functions for the tiny-model end-to-end tests (``module:function`` rewards).

The tiny model samples from a byte-level vocabulary, so a random model already earns a dense
share of these rewards and GRPO can raise it within a few steps. They are registered with
``@reward_function``, so a service that lists this module in ``controller.reward_modules`` lets
specs submitted over HTTP use them.
"""

from __future__ import annotations

import time
from typing import Any

from miles_multilora.data.reward_registry import reward_function


def _share(text: str, allowed: str) -> float:
    return sum(ch in allowed for ch in text) / max(len(text), 1)


@reward_function
def fraction_of_letter_a(prompt: str, completion: str, answer: Any, metadata: dict[str, Any]) -> float:
    """Share of the completion's characters that are the letter ``a`` (sparse for a random model)."""
    return _share(completion, "a")


@reward_function
def fraction_of_lowercase(prompt: str, completion: str, answer: Any, metadata: dict[str, Any]) -> float:
    """Share of the completion's characters that are lowercase ASCII letters."""
    return _share(completion, "abcdefghijklmnopqrstuvwxyz")


@reward_function
def fraction_of_digits(
    prompts: list[str], completions: list[str], answers: list[Any], metadatas: list[dict[str, Any]]
) -> list[float]:
    """Batched: share of each completion's characters that are digits."""
    return [_share(text, "0123456789") for text in completions]


@reward_function
def huge_reward(prompt: str, completion: str, answer: Any, metadata: dict[str, Any]) -> float:
    """A broken reward: a finite value so large that statistics over it overflow."""
    return 1e308


@reward_function
def lowercase_majority(prompt: str, completion: str, answer: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """Share of lowercase ASCII letters, ``correct`` when they are at least half the characters."""
    share = _share(completion, "abcdefghijklmnopqrstuvwxyz")
    return {"reward": share, "correct": share >= 0.5}


@reward_function
def sleeps_forever(prompt: str, completion: str, answer: Any, metadata: dict[str, Any]) -> float:
    """A reward that never returns (a blocked call to a service that is gone)."""
    while True:
        time.sleep(1.0)


SLOW_REWARD_S = 0.6


@reward_function
def slow_lowercase(
    prompts: list[str], completions: list[str], answers: list[Any], metadatas: list[dict[str, Any]]
) -> list[float]:
    """Batched: share of lowercase ASCII letters, after :data:`SLOW_REWARD_S` seconds (a slow verifier)."""
    time.sleep(SLOW_REWARD_S)
    return [_share(text, "abcdefghijklmnopqrstuvwxyz") for text in completions]
