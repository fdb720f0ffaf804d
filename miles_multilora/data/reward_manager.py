"""Scoring a step's samples for many adapters at once, each adapter isolated from the others.

Every adapter is scored in its own thread, concurrently with the others. A reward that runs spec
code (custom functions, user regexes, ``math_verify``, ``reasoning_gym``) is scored in the
adapter's own reward process (:mod:`miles_multilora.data.reward_process`), which is killed when a
call runs past ``reward.timeout_s`` (plus ``trainer.reward_kill_grace_s``) or all of a step's calls
past ``trainer.reward_step_timeout_s``: a reward that hangs in Python or in C, holding the GIL or
not, costs its adapter that timeout and nothing else. Only
``exact_match`` without a ``format_regex`` runs in this process (it cannot hang), each call in a
daemon thread bounded by ``reward.timeout_s``.

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
from miles_multilora.data.reward_process import (
    RewardCallError,
    RewardProcess,
    RewardProcessLimits,
    RewardTimeoutError,
)
from miles_multilora.data.rewards import (
    RewardFunction,
    RewardOutput,
    build_reward,
    check_reward_spec,
    runs_in_process,
)

__all__ = ["AdapterRewards", "RewardManager", "RewardTimeoutError", "call_with_timeout"]

T = TypeVar("T")


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
    fn: RewardFunction | RewardProcess
    max_failures: int
    consecutive_failures: int = 0
    failures_total: int = 0
    timeouts_total: int = 0
    failed_reason: str | None = None


class RewardManager:
    """Per-adapter reward functions with timeouts, failure isolation and metrics.

    ``limits`` bound the reward processes (start-up time, kill grace, memory); :meth:`close`
    ends them all (they also die with this process).
    """

    def __init__(self, limits: RewardProcessLimits | None = None) -> None:
        self.limits = limits or RewardProcessLimits()
        self._adapters: dict[str, _AdapterRewardState] = {}
        self._lock = threading.Lock()
        self._used: dict[str, int] = {}  # adapter -> when it was last scored (for the process cap)
        self._clock = 0

    def add_adapter(self, spec: AdapterSpec, dataset: Any | None = None) -> None:
        """Register ``spec``'s reward (raises :class:`SpecError` before changing anything).

        A reward process is started on the adapter's first scoring call, not here."""
        fn: RewardFunction | RewardProcess
        if runs_in_process(spec):
            fn = build_reward(spec, dataset)
        else:
            check_reward_spec(spec)  # resolves a custom function; the reward is built in its process
            fn = RewardProcess(spec, self.limits)
        with self._lock:
            old = self._adapters.pop(spec.name, None)
            self._adapters[spec.name] = _AdapterRewardState(fn, spec.reward.max_consecutive_failures)
        if old is not None and isinstance(old.fn, RewardProcess):
            old.fn.close()

    def remove_adapter(self, name: str) -> None:
        self._used.pop(name, None)
        with self._lock:
            state = self._adapters.pop(name, None)
        if state is not None and isinstance(state.fn, RewardProcess):
            state.fn.close()

    def close(self) -> None:
        """Remove every adapter and end its reward process."""
        for name in list(self._adapters):
            self.remove_adapter(name)

    def process(self, name: str) -> RewardProcess | None:
        """``name``'s reward process (None when its reward runs in this process)."""
        fn = self._adapters[name].fn
        return fn if isinstance(fn, RewardProcess) else None

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
        if isinstance(fn, RewardProcess):
            return fn.score(samples)
        timeout_s = fn.spec.timeout_s
        if fn.batched:
            return call_with_timeout(lambda: fn.score_batch(samples), timeout_s, f"reward[{name}]")
        return [call_with_timeout(lambda s=s: fn.score(s), timeout_s, f"reward[{name}]") for s in samples]

    def score(self, batch: Mapping[str, Sequence[RewardSample]]) -> dict[str, AdapterRewards]:
        """Score ``{adapter: samples}``; adapters run concurrently and fail independently.

        Unknown adapter names raise ``KeyError`` before anything runs. An adapter already marked
        failed is not scored (its result has ``failed=True`` and no rewards).
        """
        unknown = [name for name in batch if name not in self._adapters]
        if unknown:
            raise KeyError(f"no reward registered for adapters {unknown}")
        self._end_idle_processes(set(batch))
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

    def _end_idle_processes(self, needed: set[str]) -> None:
        """End the least recently used reward processes so that, with ``needed``'s, at most
        ``limits.max_live`` are alive (an ended one starts again on its next call)."""
        self._clock += 1
        for name in needed:
            self._used[name] = self._clock
        with self._lock:
            processes = {n: st.fn for n, st in self._adapters.items() if isinstance(st.fn, RewardProcess)}
        live = [n for n, process in processes.items() if process.pid is not None]
        starting = sum(1 for n in needed if n in processes and n not in live)
        idle = sorted((n for n in live if n not in needed), key=lambda n: self._used.get(n, 0))
        excess = len(live) + starting - self.limits.max_live
        for name in idle[: max(0, excess)]:
            processes[name].close()

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
        error = str(exc) if isinstance(exc, RewardCallError) else f"{type(exc).__name__}: {exc}"
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
