"""A spec value that slipped past every registration check (injected into the trainer's snapshot,
as a spec restored from an older version's state would be) fails its own adapter with the reason;
the other adapter keeps stepping in the same shared generation and the trainer keeps serving. The
real controller core, RL step and trainer rank (tiny model, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_multilora.controller import ControllerCore
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config
from tests.unit.test_rl_step import adapter, apply


@pytest.mark.parametrize("max_staleness", [0, 1])  # synchronous steps; continuous rollout
def test_top_k_past_the_checks_fails_its_adapter_and_the_other_keeps_stepping(
    tmp_path: Path, max_staleness: int
) -> None:
    specs = [adapter("healthy", 3), adapter("poisoned", 3)]
    cfg = tiny_run_config(
        tmp_path / "out",
        specs,
        lora={"num_slots": 2, "max_rank": 8},
        rollout={"max_staleness": max_staleness},
    )
    core = ControllerCore(num_slots=2, max_rank=8)
    for spec in specs:
        core.register(spec)
    rank = TrainerRank(cfg)
    try:
        step = RLStep(rank, cfg)
        for _ in range(6):
            snapshot = core.snapshot()
            if not snapshot.adapters:
                break
            for a in snapshot.adapters:
                if a.name == "poisoned":
                    a.spec.sampling.top_k = 10**30  # past validation: overflowed the engine's int64
            apply(core, step.step(snapshot))
        records = {r["name"]: r for r in core.list(all_runs=True)}
        assert records["poisoned"]["state"] == "FAILED"
        assert "sampling.top_k" in records["poisoned"]["reason"], records["poisoned"]["reason"]
        assert records["healthy"]["state"] == "DONE" and records["healthy"]["step"] == 3
    finally:
        compat.destroy_distributed()
