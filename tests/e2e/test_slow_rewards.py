"""A reward that always times out never holds another adapter (tiny model, in process, the real
controller core): the healthy neighbour keeps >= 60% of its step rate alone, and a cancel of the
slow adapter lands at the next step, its scoring in flight abandoned (its reward process killed)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest

from miles_multilora.controller import ControllerCore
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from miles_multilora.rl import checkpoint as ckpt
from tests.e2e.conftest import tiny_run_config, toy_adapter
from tests.unit.test_rl_step import drive

WAIT_S = 0.5  # trainer.reward_wait_s


def _specs(slow_timeout_s: float) -> tuple[dict, dict]:
    healthy = toy_adapter("healthy", "fraction_of_lowercase", steps=1000)
    slow = toy_adapter("slow", "sleeps_forever", steps=1000)
    slow["reward"] |= {"timeout_s": slow_timeout_s, "max_consecutive_failures": 20}
    return healthy, slow


def _start(tmp_path: Path, specs: list[dict], max_staleness: int) -> tuple[ControllerCore, RLStep]:
    cfg = tiny_run_config(
        tmp_path / "out",
        specs,
        trainer={"reward_wait_s": WAIT_S, "reward_kill_grace_s": 0.2},
        rollout={"max_staleness": max_staleness},
    )
    core = ControllerCore(num_slots=2, max_rank=8)
    return core, RLStep.build(cfg)


def _healthy_steps(core: ControllerCore, worker: RLStep, steps: int) -> list[float]:
    """The wall time of each of the next ``steps`` steps, each of which must train healthy."""
    times = []
    for _ in range(steps):
        before = core.get("healthy")["step"]
        start = time.perf_counter()
        drive(core, [worker])
        times.append(time.perf_counter() - start)
        assert core.get("healthy")["step"] == before + 1
    return times


def _mean_step_s(times: list[float]) -> float:
    """The typical step: the median (a step that a reward process's restart on this 2-core machine
    happens to slow does not count; without the fix every step waits the reward's 3 s)."""
    return statistics.median(times)


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["synchronous", "continuous"])
def test_an_always_timing_out_reward_does_not_slow_its_neighbour(tmp_path: Path, max_staleness: int) -> None:
    """The healthy adapter trains in every step beside the slow one, at >= 60% of its rate alone (the
    median step time). Not 100%: the slow adapter's own rows share every engine call, and its reward
    process is restarted after each timeout on this 2-core machine (measured 0.74-0.9 of alone under
    load); the defect this guards against held every step for the slow reward: 0.03 of alone."""
    healthy, slow = _specs(slow_timeout_s=3.0)
    core, worker = _start(tmp_path, [healthy, slow], max_staleness)
    try:
        core.register(healthy)
        for _ in range(40):  # warm-up: its reward process starts (its first rewards may come late)
            if core.get("healthy")["step"] >= 2:
                break
            drive(core, [worker])
        alone = _mean_step_s(_healthy_steps(core, worker, 12))
        core.register(slow)
        drive(core, [worker])  # the slow one's first scoring is waited for (at most the wait)
        beside = _mean_step_s(_healthy_steps(core, worker, 12))
        assert 1 / beside >= 0.6 / alone, (beside, alone)
        assert core.get("slow")["step"] == 0 and core.get("slow")["state"] == "RUNNING"
        if not worker.pending.busy("slow"):  # its scoring timed out in the last step: the next rescores
            drive(core, [worker])
        assert worker.pending.busy("slow")  # its groups wait for their rewards
    finally:
        worker.rewards.close()
        compat.destroy_distributed()


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["synchronous", "continuous"])
def test_a_cancel_does_not_wait_for_a_reward_in_flight(tmp_path: Path, max_staleness: int) -> None:
    healthy, slow = _specs(slow_timeout_s=60.0)
    core, worker = _start(tmp_path, [healthy, slow], max_staleness)
    try:
        core.register(healthy)
        core.register(slow)
        start = time.perf_counter()
        drive(core, [worker])
        process = worker.rewards.process("slow")
        assert process is not None
        deadline = time.monotonic() + 10
        while process.pid is None and time.monotonic() < deadline:  # it starts in the background
            time.sleep(0.01)
        pid = process.pid
        assert pid is not None  # its scoring is in flight
        untrained = [[int(p) for p in item.uid.rsplit(":", 2)[1:]] for item in worker.pending.items("slow")]
        assert untrained  # its groups wait for their rewards
        core.cancel("slow")
        drive(core, [worker])  # the cancel lands: final checkpoint, scoring abandoned
        elapsed = time.perf_counter() - start
        record = core.get("slow")
        assert record["state"] == "CANCELLED", record
        requeue = ckpt.read_state(record["last_checkpoint"])["data"]["requeue"]
        assert requeue[: len(untrained)] == untrained  # a new run of it would draw them again first
        assert elapsed < 30, elapsed  # far below the reward's 60 s timeout
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:  # SIGKILLed: gone in a moment
            time.sleep(0.01)
        assert not _alive(pid)  # its reward process was killed
        assert not worker.pending.busy("slow")
        assert worker.version("healthy") >= 1
    finally:
        worker.rewards.close()
        compat.destroy_distributed()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"
