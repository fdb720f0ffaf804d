"""Scoring a step's samples for many adapters at once, each adapter isolated from the others.

Every adapter is scored in its own thread, concurrently with the others. Each reward call
(one sample, or one batch for batched functions) runs in a daemon thread bounded by
``reward.timeout_s``; a call that hangs is abandoned (its thread may linger), never waited on.
An exception, a bad return value or a timeout fails that adapter's batch for this step only:
the failure is counted in the adapter's metrics, and after ``reward.max_consecutive_failures``
failing steps in a row the adapter is marked failed with the reason and no longer scored.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.data.records import RewardSample
from miles_multilora.data.rewards import RewardFunction, RewardOutput, build_reward

T = TypeVar("T")


class RewardTimeoutError(TimeoutError):
    """A reward call did not return within ``reward.timeout_s``."""


def call_with_timeout(fn: Callable[[], T], timeout_s: float, name: str = "reward") -> T:
    """Run ``fn()`` in a daemon thread and return its result, or raise its exception.

    Raises :class:`RewardTimeoutError` after ``timeout_s`` seconds; the thread is then abandoned.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"{name}-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeoutError(f"{name} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass
class AdapterRewards:
    """One adapter's scoring result for a step.

    ``rewards`` / ``correct`` align with the samples; both are ``None`` when this step's scoring
    failed (``error`` says why). ``failed`` means the adapter has hit its consecutive-failure limit.
    """

    adapter: str
    rewards: list[float] | None
    correct: list[bool | None] | None = None
    error: str | None = None
    failed: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rewards is not None


@dataclass
class _AdapterRewardState:
    fn: RewardFunction
    timeout_s: float
    max_failures: int
    consecutive_failures: int = 0
    failures_total: int = 0
    timeouts_total: int = 0
    failed_reason: str | None = None


class RewardManager:
    """Per-adapter reward functions with timeouts, failure isolation and metrics."""

    def __init__(self) -> None:
        self._adapters: dict[str, _AdapterRewardState] = {}
        self._lock = threading.Lock()

    def add_adapter(self, spec: AdapterSpec, dataset: Any | None = None) -> None:
        """Register ``spec``'s reward (raises :class:`SpecError` before changing anything)."""
        fn = build_reward(spec, dataset)
        with self._lock:
            self._adapters[spec.name] = _AdapterRewardState(
                fn, spec.reward.timeout_s, spec.reward.max_consecutive_failures
            )

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name, None)

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def is_failed(self, name: str) -> bool:
        return self._adapters[name].failed_reason is not None

    def failure_reason(self, name: str) -> str | None:
        return self._adapters[name].failed_reason

    def reset_failures(self, name: str) -> None:
        """Clear the failed mark and the consecutive count (e.g. after the user fixed the reward)."""
        state = self._adapters[name]
        state.consecutive_failures = 0
        state.failed_reason = None

    def _score_adapter(
        self, name: str, state: _AdapterRewardState, samples: Sequence[RewardSample]
    ) -> list[RewardOutput]:
        fn = state.fn
        if fn.batched:
            return call_with_timeout(lambda: fn.score_batch(samples), state.timeout_s, f"reward[{name}]")
        return [
            call_with_timeout(lambda s=s: fn.score(s), state.timeout_s, f"reward[{name}]") for s in samples
        ]

    def score(self, batch: Mapping[str, Sequence[RewardSample]]) -> dict[str, AdapterRewards]:
        """Score ``{adapter: samples}``; adapters run concurrently and fail independently.

        Unknown adapter names raise ``KeyError`` before anything runs. An adapter already marked
        failed is not scored (its result has ``failed=True`` and no rewards).
        """
        unknown = [name for name in batch if name not in self._adapters]
        if unknown:
            raise KeyError(f"no reward registered for adapters {unknown}")
        outcomes: dict[str, tuple[list[RewardOutput] | None, BaseException | None, float]] = {}

        def run(name: str, state: _AdapterRewardState, samples: Sequence[RewardSample]) -> None:
            start = time.perf_counter()
            try:
                outcomes[name] = (
                    self._score_adapter(name, state, samples),
                    None,
                    time.perf_counter() - start,
                )
            except BaseException as exc:  # noqa: BLE001 - isolated per adapter
                outcomes[name] = (None, exc, time.perf_counter() - start)

        threads = []
        for name, samples in batch.items():
            state = self._adapters[name]
            if state.failed_reason is not None or not samples:
                continue
            thread = threading.Thread(
                target=run, args=(name, state, list(samples)), name=f"score-{name}", daemon=True
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()  # each adapter thread is bounded: it stops at its first failing/timed-out call

        return {name: self._record(name, samples, outcomes.get(name)) for name, samples in batch.items()}

    def _record(
        self,
        name: str,
        samples: Sequence[RewardSample],
        outcome: tuple[list[RewardOutput] | None, BaseException | None, float] | None,
    ) -> AdapterRewards:
        state = self._adapters[name]
        if outcome is None:  # not scored: already failed, or nothing to score
            if state.failed_reason is not None:
                return AdapterRewards(
                    name, None, error=state.failed_reason, failed=True, metrics=self._counters(state)
                )
            return AdapterRewards(name, [], [], metrics=self._counters(state))
        outputs, exc, latency = outcome
        if exc is None and outputs is not None:
            state.consecutive_failures = 0
            rewards = [o.reward for o in outputs]
            correct = [o.correct for o in outputs]
            metrics = self._counters(state)
            metrics["reward/mean"] = statistics.fmean(rewards)
            metrics["reward/std"] = statistics.pstdev(rewards)
            known = [c for c in correct if c is not None]
            if known:
                metrics["reward/accuracy"] = sum(known) / len(known)
            metrics["reward/latency_s"] = latency
            return AdapterRewards(name, rewards, correct, metrics=metrics)
        state.consecutive_failures += 1
        state.failures_total += 1
        if isinstance(exc, RewardTimeoutError):
            state.timeouts_total += 1
        error = f"{type(exc).__name__}: {exc}"
        if state.consecutive_failures >= state.max_failures:
            state.failed_reason = (
                f"reward failed {state.consecutive_failures} consecutive steps; last error: {error}"
            )
        metrics = self._counters(state)
        metrics["reward/latency_s"] = latency
        return AdapterRewards(
            name, None, None, error=error, failed=state.failed_reason is not None, metrics=metrics
        )

    @staticmethod
    def _counters(state: _AdapterRewardState) -> dict[str, float]:
        return {
            "reward/failures_total": float(state.failures_total),
            "reward/timeouts_total": float(state.timeouts_total),
            "reward/consecutive_failures": float(state.consecutive_failures),
        }
