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

:meth:`RewardManager.score` waits for every adapter; :meth:`~RewardManager.start`,
:meth:`~RewardManager.wait` and :meth:`~RewardManager.take` let each adapter's scoring finish on
its own time (the RL step trains the adapters whose rewards are in, :mod:`miles_multilora.rl.scoring`),
and :meth:`~RewardManager.abandon` drops one in flight (its process killed).
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


_Outcome = tuple[list[RewardOutput] | None, BaseException | None, float]  # outputs, error, latency


@dataclass
class _Job:
    """One adapter's scoring in the background: its samples, and its outcome once it finished
    (None when it was not scored: the adapter had failed already, or nothing to score)."""

    samples: list[RewardSample]
    started: float
    done: bool = False
    finished_at: float | None = None
    outcome: _Outcome | None = None

    def finish(self, outcome: _Outcome | None) -> None:
        self.outcome, self.done, self.finished_at = outcome, True, time.monotonic()


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
        self._jobs: dict[str, _Job] = {}  # adapter -> its scoring started and not taken yet
        self._done = threading.Condition()  # notified whenever a job finishes

    def add_adapter(self, spec: AdapterSpec, dataset: Any | None = None) -> None:
        """Register ``spec``'s reward (raises :class:`SpecError` before changing anything).

        A reward process is started on the adapter's first scoring call, not here."""
        fn: RewardFunction | RewardProcess
        if runs_in_process(spec):
            fn = build_reward(spec, dataset)
        else:
            check_reward_spec(spec)  # resolves a custom function; the reward is built in its process
            fn = RewardProcess(spec, self.limits)
        self.abandon(spec.name)
        with self._lock:
            old = self._adapters.pop(spec.name, None)
            self._adapters[spec.name] = _AdapterRewardState(fn, spec.reward.max_consecutive_failures)
        if old is not None and isinstance(old.fn, RewardProcess):
            old.fn.close()

    def remove_adapter(self, name: str) -> None:
        self.abandon(name)
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

    def failure_reason(self, name: str) -> str | None:
        return self._adapters[name].failed_reason

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
        self.start(batch)
        self.wait(list(batch))
        return self.take(list(batch))

    # ------------------------------------------------------------- in the background
    def start(self, batch: Mapping[str, Sequence[RewardSample]]) -> None:
        """Start scoring ``{adapter: samples}`` in the background, one thread per adapter, and
        return at once; :meth:`wait` / :meth:`take` collect the results. Raises ``KeyError`` for
        an unknown adapter and ``RuntimeError`` for one whose last scoring was not taken yet,
        before anything starts."""
        unknown = [name for name in batch if name not in self._adapters]
        if unknown:
            raise KeyError(f"no reward registered for adapters {unknown}")
        busy = [name for name in batch if name in self._jobs]
        if busy:
            raise RuntimeError(f"adapters {busy} are still being scored (take their results first)")
        self._end_idle_processes(set(batch))
        for name, samples in batch.items():
            state = self._adapters[name]
            job = self._jobs[name] = _Job(list(samples), time.monotonic())
            if state.failed_reason is not None or not samples:
                job.finish(None)  # not scored
                continue
            thread = threading.Thread(
                target=self._run_job, args=(name, state, job), name=f"score-{name}", daemon=True
            )
            thread.start()

    def _run_job(self, name: str, state: _AdapterRewardState, job: _Job) -> None:
        start = time.perf_counter()
        try:
            outcome: _Outcome = (self._score_adapter(name, state, job.samples), None, 0.0)
        except BaseException as exc:  # noqa: BLE001 - isolated per adapter
            outcome = (None, exc, 0.0)
        with self._done:
            job.finish((outcome[0], outcome[1], time.perf_counter() - start))
            self._done.notify_all()

    @property
    def scoring(self) -> list[str]:
        """The adapters whose last scoring was started and not taken yet (finished or not)."""
        return list(self._jobs)

    def finished(self, names: Sequence[str]) -> set[str]:
        """Those of ``names`` whose scoring has finished (their results wait for :meth:`take`)."""
        return {n for n in names if (job := self._jobs.get(n)) is not None and job.done}

    def wait(self, names: Sequence[str], timeout_s: float | None = None, *, any_of: bool = False) -> set[str]:
        """Wait until every one of ``names`` being scored has finished (``any_of``: one of them), at
        most ``timeout_s`` seconds (None: as long as they take: each call is bounded by its
        timeouts); returns the finished ones."""
        names = [n for n in names if n in self._jobs]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._done:
            while True:
                done = self.finished(names)
                if len(done) == len(names) or (any_of and done):
                    return done
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return done
                self._done.wait(left)

    def latency(self, name: str) -> float | None:
        """How long ``name``'s scoring has taken so far, or took (None: none since its last take)."""
        job = self._jobs.get(name)
        if job is None:
            return None
        return (job.finished_at or time.monotonic()) - job.started

    def take(self, names: Sequence[str]) -> dict[str, AdapterRewards]:
        """The results of ``names``' finished scoring (counted in their failure counters); the
        others are left running."""
        out = {}
        done = self.finished(names)
        for name in (n for n in names if n in done):  # in the order asked (ranks train in this order)
            job = self._jobs.pop(name)
            out[name] = self._record(name, job.samples, job.outcome)
        return out

    def abandon(self, name: str) -> None:
        """Drop ``name``'s scoring in flight, if any, without counting it: its reward process is
        killed (an in-process reward's call is left to end by its timeout, unheard)."""
        job = self._jobs.pop(name, None)
        state = self._adapters.get(name)
        if job is None or job.done or state is None or not isinstance(state.fn, RewardProcess):
            return
        old = state.fn
        state.fn = RewardProcess(old.spec, self.limits)  # the abandoned call's thread keeps the old one
        old.kill()

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
        idle = sorted(
            (n for n in live if n not in needed and n not in self._jobs), key=lambda n: self._used.get(n, 0)
        )
        excess = len(live) + starting - self.limits.max_live
        for name in idle[: max(0, excess)]:
            processes[name].close()

    def _record(
        self,
        name: str,
        samples: Sequence[RewardSample],
        outcome: _Outcome | None,
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
