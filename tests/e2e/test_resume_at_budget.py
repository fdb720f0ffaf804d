"""An adapter resumed from a checkpoint at its step budget finishes without another step.

This happens when the service died after writing its last checkpoint but before reporting it,
and the controller's resume point is gone or unreadable: the trainer falls back to the newest
checkpoint, which is already at the budget. It must not train a step past ``num_steps``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.controller.snapshot import SlotAssignment, Snapshot
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from miles_multilora.rl import checkpoint_layout as layout
from tests.e2e.conftest import tiny_run_config, toy_adapter


@pytest.mark.parametrize("fallback", [False, True], ids=["named", "fallback"])
def test_resumed_at_budget_finishes_without_training(tmp_path: Path, fallback: bool) -> None:
    raw = toy_adapter("a", "fraction_of_lowercase", steps=2, save_interval=1)
    worker = RLStep.build(tiny_run_config(tmp_path / "out", [raw]))
    try:
        spec = parse_adapter_spec(raw, max_rank=8)
        worker.step(Snapshot(1, 2, (SlotAssignment("a", "a-1", 0, spec, 0, None, True),), (), ()))
        out = worker.step(Snapshot(2, 2, (SlotAssignment("a", "a-1", 0, spec, 1, None, False),), (), ()))
        assert list(out.finished) == ["a"] and out.results["a"].step == 2
        first, last = layout.complete_checkpoints(layout.run_dir(tmp_path / "out", "a", "a-1"))
        if fallback:  # the controller still names step 1, which is now unreadable
            (first / "slot_rank0.pt").write_bytes(b"not a torch file")
        named = first if fallback else last
        worker.residents.clear_slots((0,))  # a restarted trainer: nothing resident
        again = SlotAssignment("a", "a-1", 0, spec, 1, str(named), True)
        out = worker.step(Snapshot(3, 2, (again,), (), ()))
        assert out.finished == {"a": str(last)} and not out.failed
        assert out.results["a"].trained is False and out.results["a"].step == 2
        assert worker.version("a") == 2
        assert [p.name for p in layout.complete_checkpoints(last.parent)] == ["step_000001", "step_000002"]
    finally:
        compat.destroy_distributed()
