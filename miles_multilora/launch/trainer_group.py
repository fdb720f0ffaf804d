"""The run's trainer ranks as one supervised group: a group that dies is replaced, not fatal.

A rank's process can die (OOM killer, a SIGKILL, a lost node) or a step can raise. Either way the
ranks' states no longer agree, so the whole group goes: the driver kills every rank, tells the
controller (every resident adapter resumes from its last complete checkpoint, exactly as after a
service restart), waits a backoff and starts a new group. ``trainer.max_restarts`` bounds the
restarts in a row without a completed step (then the run stops with the last error); the
controller's ``/health`` counts them. Once a stop is requested, the step in flight gets
``trainer.stop_timeout_s`` more seconds; past that it is abandoned (:class:`StepAbandoned`) and the
caller ends the ranks: nothing a step does (a reward, a dataset) can keep a run from stopping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from rich.console import Console

from miles_multilora.config.run import RunConfig
from miles_multilora.controller.snapshot import Snapshot, StepReport
from miles_multilora.launch.cluster import start_trainer_group

TRAINER_LOST = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.WorkerCrashedError)
MAX_BACKOFF_S = 60.0
WAIT_POLL_S = 0.2  # how often the driver looks at the stop flag while a step runs


class TrainerGroupFailed(RuntimeError):
    """The trainer group died more than ``trainer.max_restarts`` times in a row."""


class StepAbandoned(RuntimeError):
    """The step in flight did not finish within ``stop_timeout_s`` of a stop request."""


class TrainerGroup:
    """``cfg.trainer.world_size`` trainer ranks (Ray actors), replaced when one dies."""

    def __init__(self, cfg: RunConfig, controller: Any, console: Console) -> None:
        self.cfg = cfg
        self.controller = controller
        self.console = console
        self.workers: list[Any] = start_trainer_group(cfg)
        self.restarts = 0  # groups replaced in this run
        self._failures_in_a_row = 0

    def step(
        self,
        snapshot: Snapshot,
        should_stop: Callable[[], bool] | None = None,
        stop_timeout_s: float | None = None,
    ) -> StepReport | None:
        """Rank 0's report of one step on every rank, or None when the group died during it (then
        it has been replaced and the controller has rewound the resident adapters). Raises
        :class:`StepAbandoned` when a stop was asked ``stop_timeout_s`` ago and the step still runs."""
        try:
            outs = _get_all_or_first_error(
                [w.step.remote(snapshot) for w in self.workers], should_stop, stop_timeout_s
            )
        except TRAINER_LOST as exc:
            self._replace(exc, should_stop)
            return None
        self._failures_in_a_row = 0
        return outs[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank (checkpoints on a graceful stop)."""
        return _get_all_or_first_error([getattr(w, method).remote(*args) for w in self.workers])

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    def _replace(self, error: BaseException, should_stop: Callable[[], bool] | None) -> None:
        while True:
            self._failures_in_a_row += 1
            limit = self.cfg.trainer.max_restarts
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if self._failures_in_a_row > limit:
                self.kill()
                raise TrainerGroupFailed(
                    f"the trainer group died {self._failures_in_a_row} times in a row (trainer.max_restarts"
                    f"={limit}); last error: {first_line}"
                ) from error
            delay = min(
                self.cfg.trainer.restart_backoff_s * 2 ** (self._failures_in_a_row - 1), MAX_BACKOFF_S
            )
            self.console.print(
                f"[yellow]trainer group lost[/yellow] ({first_line}); restart "
                f"{self._failures_in_a_row}/{limit} in {delay:.0f}s, every adapter resumes from its "
                "last checkpoint",
                soft_wrap=True,
            )
            self.kill()
            if _sleep_unless(delay, should_stop):
                return  # a stop was asked for: the caller's loop ends; nothing left to restart
            ray.get(self.controller.trainer_restarted.remote())
            try:
                self.workers = start_trainer_group(self.cfg)
            except TRAINER_LOST as exc:
                error = exc
                continue
            self.restarts += 1
            return


def _get_all_or_first_error(
    refs: list[Any], should_stop: Callable[[], bool] | None = None, stop_timeout_s: float | None = None
) -> list[Any]:
    """``ray.get(refs)``, but raising as soon as any call fails (the other ranks may be blocked in a
    collective with the dead one and would never return), and :class:`StepAbandoned` once
    ``should_stop()`` has held for ``stop_timeout_s`` (None: wait for the end)."""
    pending, stopped_at = list(refs), None
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=WAIT_POLL_S)
        ray.get(done)
        if stop_timeout_s is None or should_stop is None or not pending:
            continue
        if stopped_at is None and should_stop():
            stopped_at = time.monotonic()
        if stopped_at is not None and time.monotonic() - stopped_at >= stop_timeout_s:
            raise StepAbandoned(
                f"the step in flight did not finish within {stop_timeout_s:g} s of the stop request "
                "(trainer.stop_timeout_s); abandoned: its adapters resume from their last checkpoints"
            )
    return ray.get(refs)


def _sleep_unless(seconds: float, should_stop: Callable[[], bool] | None) -> bool:
    """Sleep ``seconds`` in short naps; True as soon as ``should_stop()`` holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if should_stop is not None and should_stop():
            return True
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return bool(should_stop and should_stop())
