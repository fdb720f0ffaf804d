"""Interleave policies: which adapters get prompts at a step.

``round_robin`` (default) cycles through adapters in registration order, ``adapters_per_step``
at a time (``None`` = all of them every step). ``weighted`` draws ``adapters_per_step``
adapters (default 1) without replacement with probability proportional to their weights.
Both keep their own state (cursor / RNG) for exact resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from miles_multilora.errors import ConfigError

POLICIES = ("round_robin", "weighted")


class InterleavePolicy:
    """Base: tracks the registered adapters and their weights in registration order."""

    name = "base"

    def __init__(self, adapters_per_step: int | None = None) -> None:
        if adapters_per_step is not None and adapters_per_step < 1:
            raise ConfigError(
                "data.adapters_per_step", f"must be >= 1 or null (all), got {adapters_per_step}"
            )
        self.adapters_per_step = adapters_per_step
        self.order: list[str] = []
        self.weights: dict[str, float] = {}

    def add(self, name: str, weight: float = 1.0) -> None:
        if not weight > 0:
            raise ConfigError(f"data.weights.{name}", f"must be > 0, got {weight}")
        if name not in self.weights:
            self.order.append(name)
        self.weights[name] = float(weight)

    def remove(self, name: str) -> None:
        if name in self.weights:
            self.order.remove(name)
            del self.weights[name]

    def select(self, candidates: list[str]) -> list[str]:
        """The adapters (subset of ``candidates``, in registration order) that get prompts now."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name, "order": list(self.order), "weights": dict(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy") != self.name:
            raise ConfigError(
                "data.policy",
                f"checkpoint used policy {state.get('policy')!r}, this source uses {self.name!r}",
            )
        self.order = list(state["order"])
        self.weights = {k: float(v) for k, v in state["weights"].items()}


class RoundRobinPolicy(InterleavePolicy):
    """Cycle through adapters; each step takes the next ``adapters_per_step`` eligible ones."""

    name = "round_robin"

    def __init__(self, adapters_per_step: int | None = None) -> None:
        super().__init__(adapters_per_step)
        self.next_name: str | None = None  # adapter the next step starts from

    def remove(self, name: str) -> None:
        if name == self.next_name and name in self.order:
            i = self.order.index(name)
            rest = self.order[i + 1 :] + self.order[:i]
            self.next_name = rest[0] if rest else None
        super().remove(name)

    def select(self, candidates: list[str]) -> list[str]:
        eligible = set(candidates)
        if not self.order or not eligible:
            return []
        start = self.order.index(self.next_name) if self.next_name in self.order else 0
        rotated = self.order[start:] + self.order[:start]
        picked = [n for n in rotated if n in eligible]
        if self.adapters_per_step is not None:
            picked = picked[: self.adapters_per_step]
        if picked:
            last = rotated.index(picked[-1])
            self.next_name = rotated[(last + 1) % len(rotated)]
        chosen = set(picked)
        return [n for n in self.order if n in chosen]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "next_name": self.next_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.next_name = state.get("next_name")


class WeightedPolicy(InterleavePolicy):
    """Sample ``adapters_per_step`` (default 1) adapters per step, proportionally to their weights."""

    name = "weighted"

    def __init__(self, adapters_per_step: int | None = None, seed: int = 0) -> None:
        super().__init__(adapters_per_step)
        self.rng = np.random.default_rng(seed)

    def select(self, candidates: list[str]) -> list[str]:
        eligible = [n for n in self.order if n in set(candidates)]
        k = min(self.adapters_per_step or 1, len(eligible))
        if k == 0:
            return []
        p = np.array([self.weights[n] for n in eligible], dtype=np.float64)
        picked = set(self.rng.choice(len(eligible), size=k, replace=False, p=p / p.sum()).tolist())
        return [n for i, n in enumerate(eligible) if i in picked]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rng.bit_generator.state = state["rng"]


def make_policy(policy: str, adapters_per_step: int | None = None, seed: int = 0) -> InterleavePolicy:
    """The interleave policy named ``policy`` (``round_robin`` | ``weighted``)."""
    if policy == "round_robin":
        return RoundRobinPolicy(adapters_per_step)
    if policy == "weighted":
        return WeightedPolicy(adapters_per_step, seed)
    raise ConfigError("data.policy", f"must be one of {POLICIES}, got {policy!r}")
