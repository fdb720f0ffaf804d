"""One adapter's reward in its own child process, killed when a call runs past its timeout.

A reward call that hangs in Python *or in C* (a catastrophic regex in ``re``, a sympy
simplification, a blocking socket) cannot be stopped inside the trainer's process: a thread that
holds the GIL starves every other thread. So each adapter whose reward runs spec code gets a
persistent child (:mod:`miles_multilora.child_process`: forked from a preloaded forkserver, dies
with the trainer, optionally memory-bounded) that builds the reward once and then scores batch
after batch. The parent waits for each result at most ``reward.timeout_s`` plus a grace; past it
the child is SIGKILLed and the call fails with :class:`RewardTimeoutError`. The next call starts a
new child (a fork, milliseconds).

Wire protocol (one pipe; parent -> child: a list of samples): ``("ready", None)`` once built,
then for each request ``("ok", [(reward, correct), ...])`` messages until every sample has its
result, or ``("error" | "timeout", text)`` after which the child drops the rest of that request.
Per-sample results are sent in groups, at least every :data:`FLUSH_S` seconds (a message per
sample would cost more than most rewards). The parent reads until it has every result or an
error, so nothing stale is ever read; it waits for each message at most ``reward.timeout_s`` plus
the grace (plus :data:`FLUSH_S`), so a sample that hangs is cut there.
"""

from __future__ import annotations

import multiprocessing.connection
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles_multilora import child_process
from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.data.records import RewardSample
from miles_multilora.data.rewards import RewardOutput, build_reward

FLUSH_S = 0.01  # per-sample results are sent at least this often


class RewardTimeoutError(TimeoutError):
    """A reward call did not return within ``reward.timeout_s``."""


class RewardCallError(RuntimeError):
    """A reward call raised, returned something unusable, or its process died (the message says which)."""


@dataclass(frozen=True)
class RewardProcessLimits:
    """The operator's bounds on reward processes (``trainer.reward_*`` in the run config)."""

    start_timeout_s: float = 60.0  # fork, import the reward's module and build it
    kill_grace_s: float = 1.0  # after reward.timeout_s a call that has not stopped by itself is killed
    memory_mb: int = 4096  # data a reward process may allocate beyond its start-up (0: unbounded)
    step_timeout_s: float = 300.0  # all of one adapter's samples of a step (calls under their timeout add up)
    max_live: int = 64  # processes alive at once per manager; past it the least recently used one ends


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _serve(conn: multiprocessing.connection.Connection, memory_mb: int, spec: Any) -> None:
    """The child: build ``spec``'s reward, then answer scoring requests until the pipe closes."""
    child_process.enter_child(memory_mb)
    try:
        fn = build_reward(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"building the reward failed: {_text(exc)}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            samples = conn.recv()
        except (EOFError, OSError):
            return
        done: list[tuple[float, bool | None]] = []
        try:
            if fn.batched:
                done = [(o.reward, o.correct) for o in fn.score_batch(samples)]
            else:
                sent = time.monotonic()
                for sample in samples:
                    out = fn.score(sample)
                    done.append((out.reward, out.correct))
                    if time.monotonic() - sent >= FLUSH_S:
                        conn.send(("ok", done))
                        done, sent = [], time.monotonic()
            conn.send(("ok", done))
        except TimeoutError as exc:  # a user regex stopped by its own timeout: the child lives on
            conn.send(("timeout", _text(exc)))
        except MemoryError as exc:
            conn.send(("error", f"{_text(exc)} (a reward process may add {memory_mb} MiB)"))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", _text(exc)))


class RewardProcess:
    """Scores one adapter's samples in a persistent child process; thread-compatible, not thread-safe
    (one adapter is scored by one thread at a time)."""

    def __init__(self, spec: AdapterSpec, limits: RewardProcessLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or RewardProcessLimits()
        self.name = f"reward[{spec.name}]"
        self.batched = spec.reward.batched
        self.starts = 0  # children started so far (1 + restarts)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._killed = False  # killed from another thread: no child is started again
        child_process.warm_up()  # the forkserver's preload overlaps the step's generation

    @property
    def pid(self) -> int | None:
        """The live child's pid (None before the first call and after a kill)."""
        return self._process.pid if self._process is not None and self._process.is_alive() else None

    def close(self) -> None:
        """Kill the child (if any); the next call starts a new one."""
        child_process.stop(self._process)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def kill(self) -> None:
        """Kill the child from another thread, for good: a call waiting on it fails at once (its
        pipe reads EOF) and cleans up after itself; one still starting it kills it once started."""
        self._killed = True
        process = self._process
        if process is not None and process.is_alive():
            process.kill()

    def _start(self) -> multiprocessing.connection.Connection:
        ctx = child_process.context()
        receive, send = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_serve,
            args=(send, self.limits.memory_mb, self.spec),
            name=self.name,
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            receive.close()
            raise
        finally:
            send.close()  # the child holds the other end: its death reads as EOF here
        self._process, self._conn = process, receive
        self.starts += 1
        if self._killed:
            self.close()
            raise RewardCallError(f"{self.name} was abandoned")
        status, value = self._receive(self.limits.start_timeout_s, "start")
        if status != "ready":
            self.close()
            raise RewardCallError(str(value))
        return receive

    def _receive(self, timeout_s: float, doing: str, step_left_s: float | None = None) -> tuple[str, Any]:
        conn = self._conn
        assert conn is not None
        wait_s = timeout_s if step_left_s is None else max(0.0, min(timeout_s, step_left_s))
        if not conn.poll(wait_s):
            self.close()
            if doing == "start":
                raise RewardCallError(
                    f"{self.name} did not start within {timeout_s:g} s (trainer.reward_start_timeout_s)"
                )
            if wait_s < timeout_s:
                raise RewardTimeoutError(
                    f"{self.name} did not score this step's samples within {self.limits.step_timeout_s:g} s "
                    "(trainer.reward_step_timeout_s); its process was killed"
                )
            raise RewardTimeoutError(
                f"{self.name} did not return within {self.spec.reward.timeout_s:g} s (reward.timeout_s); "
                "its process was killed"
            )
        try:
            return conn.recv()
        except (EOFError, OSError):
            process = self._process
            code = None
            if process is not None:
                process.join(5)
                code = process.exitcode
            self.close()
            raise RewardCallError(f"{self.name} process died (exit code {code}) while {doing}") from None

    def score(self, samples: Sequence[RewardSample]) -> list[RewardOutput]:
        """Rewards of ``samples``; raises :class:`RewardTimeoutError` (a call past its timeout, or all
        of them past ``step_timeout_s``) / :class:`RewardCallError`."""
        samples = list(samples)
        if not samples:
            return []
        conn = self._conn if self._process is not None and self._process.is_alive() else None
        if conn is None:
            self.close()
            conn = self._start()
        conn.send(samples)
        per_call = self.spec.reward.timeout_s + self.limits.kill_grace_s + FLUSH_S
        step_end = time.monotonic() + self.limits.step_timeout_s
        outputs: list[RewardOutput] = []
        while len(outputs) < len(samples):
            status, value = self._receive(per_call, "scoring", step_end - time.monotonic())
            if status == "timeout":
                raise RewardTimeoutError(
                    f"{self.name} timed out (reward.timeout_s = {self.spec.reward.timeout_s:g} s): {value}"
                )
            if status != "ok":
                raise RewardCallError(str(value))
            outputs.extend(RewardOutput(r, c) for r, c in value)
            if self.batched:
                break
        return outputs
