"""Adapters that cannot progress end FAILED with the reason while a healthy one trains on, in the
real trainer step (tiny model, in process):

- a ``format_regex`` that backtracks catastrophically: cut at ``reward.timeout_s`` in its reward
  process (killed), the adapter FAILED after its step; the healthy adapter's rewards are not delayed;
- an adapter whose every step is skipped (a non-finite gradient, vetoed by the optimizer; or a
  reward that never varies, so dynamic sampling keeps nothing): FAILED after
  ``trainer.max_skipped_steps`` steps in a row, the reason saying which.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.controller.snapshot import SlotAssignment, Snapshot
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from tests.e2e.conftest import tiny_run_config, toy_adapter

# Exponential in the length of the completion and never matches: hangs on ~30 characters.
BACKTRACKS = r"(?s)^(.|..|...)*(.|..|...)*(.|..|...)*$(?<=\d{40})"


def _snapshot(
    snapshot_id: int, specs: dict[int, dict[str, Any]], steps: dict[str, int], init: bool
) -> Snapshot:
    running = []
    for slot, raw in sorted(specs.items()):
        spec = parse_adapter_spec(raw, max_rank=8)
        step = steps.get(spec.name, 0)
        running.append(SlotAssignment(spec.name, f"{spec.name}-1", slot, spec, step, None, init))
    return Snapshot(snapshot_id, 4, tuple(running), (), ())


def test_stuck_adapters_fail_with_the_reason_and_the_healthy_one_trains(tmp_path: Path) -> None:
    healthy = toy_adapter("healthy", "fraction_of_lowercase", steps=10)
    regex = toy_adapter("regex", "fraction_of_lowercase", steps=10, sampling={"max_new_tokens": 48})
    regex["reward"] = {
        "type": "format",
        "format_regex": BACKTRACKS,
        "timeout_s": 1.0,
        "max_consecutive_failures": 1,
    }
    flat = toy_adapter("flat", "fraction_of_lowercase", steps=10)
    flat["reward"] = {"type": "format", "format_regex": "QQQQQQ"}  # never matches: every reward 0
    nan = toy_adapter("nan", "fraction_of_lowercase", steps=10, seed=5)
    specs = {0: healthy, 1: regex, 2: flat, 3: nan}
    cfg = tiny_run_config(
        tmp_path / "out",
        list(specs.values()),
        # the step waits for the regex's scoring (cut at 1.5 s), so it fails in this step
        trainer={"max_skipped_steps": 2, "reward_kill_grace_s": 0.5, "reward_wait_s": 10.0},
        algo={"dynamic_sampling": True, "max_refill_rounds": 1},
    )
    worker = RLStep.build(cfg)
    real_step = worker.rank.optimizer.step

    def nan_gradients_for_slot_3(active: list[int]) -> Any:  # a loss that went non-finite for one adapter
        for p in worker.rank.optimizer.params:
            if p.grad is not None:
                p.grad[3] = math.nan
        return real_step(active)

    worker.rank.optimizer.step = nan_gradients_for_slot_3  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        out = worker.step(_snapshot(1, specs, {}, init=True))
        elapsed = time.perf_counter() - start
        assert set(out.failed) == {"regex"}, out.failed
        assert "reward.timeout_s" in out.failed["regex"]  # the regex stopped itself, or was killed
        assert out.results["healthy"].trained is True
        assert out.results["healthy"].metrics["reward/latency_s"] < 2.0
        assert out.results["flat"].trained is False and out.results["nan"].trained is False
        assert out.results["nan"].metrics["skipped"] == 1.0
        assert elapsed < 120, elapsed

        del specs[1]  # the controller drops the failed adapter; the others keep their slots
        out = worker.step(_snapshot(2, specs, {"healthy": 1}, init=False))
        assert set(out.failed) == {"flat", "nan"}, out.failed
        assert "no update in 2 consecutive steps (trainer.max_skipped_steps)" in out.failed["flat"]
        assert "dynamic sampling kept none" in out.failed["flat"]
        assert "not finite" in out.failed["nan"] and "sampling.temperature" in out.failed["nan"]
        assert out.results["healthy"].trained is True and worker.version("healthy") == 2
        assert all(torch.isfinite(p).all() for p in worker.rank.optimizer.params)  # the veto kept NaN out
    finally:
        worker.rewards.close()
        compat.destroy_distributed()
