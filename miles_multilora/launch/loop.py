"""The driver's step loop: one controller snapshot per step, sent to every trainer rank.

Once a stop is requested (``should_stop()``), the step in flight gets ``stop_timeout_s`` more
seconds; past that it is abandoned (``trainer_group.StepAbandoned``) and the caller ends the ranks:
nothing a step does (a reward, a dataset) can keep the service from stopping. Its adapters resume
from their last complete checkpoints, as after a crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray

from miles_multilora.controller.snapshot import Snapshot, StepReport
from miles_multilora.launch.metrics import MetricsLogger, read_metrics
from miles_multilora.launch.trainer_group import TrainerGroup
from miles_multilora.rl.checkpoint import read_state
from miles_multilora.rl.checkpoint_layout import complete_checkpoints, run_dir


def apply_report(controller: Any, report: StepReport) -> dict[str, dict[str, float]]:
    """Tell the controller what the step did (:meth:`ControllerCore.apply_report`, one call).
    Returns the stepped adapters' queue times (``queue/pending_s``, ``queue/parked_s``)."""
    return ray.get(controller.apply_report.remote(report))


def must_step(snapshot: Snapshot, held: set[str]) -> bool:
    """Whether the trainer has work in ``snapshot``: adapters to step, slots to clear, or adapters it
    holds (``held``: those of the last step it ran) whose turn ended with nobody to take their slot
    (e.g. their tenant is over its tokens_per_hour): it must park them, state and all, else it would
    start them afresh when they come back."""
    return bool(snapshot.adapters or snapshot.slots_to_clear or held & set(snapshot.parked))


def has_waiting(controller: Any) -> bool:
    records = ray.get(controller.list.remote())
    return any(r["state"] in ("PENDING", "RUNNING", "DRAINING") for r in records)


def run_loop(
    controller: Any,
    group: TrainerGroup,
    logger: MetricsLogger,
    *,
    stop_when_idle: bool = True,
    idle_sleep_s: float = 2.0,
    max_steps: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    start_step: int = 0,
    stop_timeout_s: float | None = None,
) -> int:
    """Train until every adapter has ended (one-shot) or ``should_stop()`` (service). Returns steps run.

    ``stop_timeout_s``: how long a step may still run once ``should_stop()`` is true (None: to its
    end); past it :class:`~miles_multilora.launch.trainer_group.StepAbandoned` is raised and the
    step's results are never applied.
    """
    global_step = start_step  # a resumed run continues the global step count of its metrics
    held: set[str] = set()  # the adapters the trainer holds in slots (those of the last step)
    while not (should_stop and should_stop()):
        snapshot = ray.get(controller.snapshot.remote())
        if not must_step(snapshot, held):
            if stop_when_idle and not has_waiting(controller):
                break
            time.sleep(idle_sleep_s)  # nothing RUNNING: wait with little CPU
            continue
        report = group.step(snapshot, should_stop, stop_timeout_s)
        if report is None:  # the group died and was replaced: the adapters resume from checkpoints
            held = set()
            global_step += recover_lost_metrics(logger, snapshot, global_step)
            continue
        held = {a.name for a in snapshot.adapters}
        if apply_and_log(
            lambda part: apply_report(controller, part),
            logger,
            report,
            global_step,
            lambda: _progress(controller),
        ):
            global_step += 1
        if max_steps is not None and global_step - start_step >= max_steps:
            break
    return global_step - start_step


def apply_and_log(
    apply: Callable[[StepReport], dict[str, dict[str, float]]],
    logger: MetricsLogger,
    report: StepReport,
    global_step: int,
    progress: Callable[[], tuple[int, int]],
) -> bool:
    """Give the controller ``report`` (``apply``: :func:`apply_report`) in two parts around logging
    its metrics rows: the steps first (their queue times go in the rows), then, once the rows are
    written, the adapters that ended (DONE, FAILED, drained). A client that sees an adapter end finds
    all its rows in the metrics file. Returns whether rows were logged."""
    queue = apply(replace(report, finished={}, failed={}, drained={}))
    if report.results:
        logger.log_step(
            global_step,
            {n: {**r.metrics, **queue.get(n, {})} for n, r in report.results.items()},
            dict(report.timing),
            progress=progress(),
        )
    if report.finished or report.failed or report.drained:
        apply(replace(report, results={}, cleared=()))
    return bool(report.results)


def recover_lost_metrics(logger: MetricsLogger, snapshot: Snapshot, global_step: int) -> int:
    """Log the metrics row of each adapter of ``snapshot`` whose newest checkpoint holds a step the
    metrics never got: the ranks died after saving it but before reporting the step, so the adapter
    resumes past it and would never log it again. Returns the rows logged (each its own global step)."""
    if not logger.cfg.jsonl:
        return 0
    logged = {(m.get("adapter"), m.get("step")) for m in read_metrics(logger.jsonl_path)}
    rows = 0
    for a in snapshot.adapters:
        saved = complete_checkpoints(run_dir(logger.output_dir, a.name, a.run_id))
        state = read_state(saved[-1]) if saved else {}
        metrics = state.get("metrics")
        if metrics and (a.name, metrics.get("step")) not in logged:
            logger.log_step(global_step + rows, {a.name: {**metrics, "recovered": 1}}, {})
            rows += 1
    return rows


def _progress(controller: Any) -> tuple[int, int]:
    """(adapter steps done, adapter steps budgeted) over adapters with a num_steps budget."""
    done = total = 0
    for r in ray.get(controller.list.remote()):
        budget = r.get("num_steps")
        if budget:
            total += int(budget)
            done += min(int(r.get("step") or 0), int(budget)) if r["state"] != "CANCELLED" else int(budget)
    return done, total
