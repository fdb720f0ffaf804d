"""The turn rule of adapters beyond the slots (a fair share by trained tokens, minimum residency,
DRAINING first) and the controller core taking turns: admitted adapters RUNNING without a slot,
slots handed over in one snapshot, and a restart that keeps them RUNNING."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_multilora.controller import ControllerCore
from miles_multilora.controller.residency import Candidate, ResidencyPolicy, choose_residents
from miles_multilora.controller.snapshot import AdapterResult
from tests.unit.test_rl_step import adapter


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def test_the_turn_rule_shares_trained_tokens_fairly() -> None:
    served = dict.fromkeys(range(12), 0.0)
    resident: dict[int, int] = {}
    rng = torch.Generator().manual_seed(0)
    for _ in range(600):
        candidates = [
            Candidate(str(i), i, served[i], i in resident, resident.get(i, 0), False) for i in served
        ]
        chosen = {int(c) for c in choose_residents(candidates, 4, min_residency_steps=3)}
        assert len(chosen) == 4
        resident = {i: resident.get(i, 0) + 1 for i in chosen}
        for i in chosen:  # unequal steps: each adapter's samples have their own lengths
            served[i] += float(torch.randint(100, 400, (1,), generator=rng))
    assert jain(list(served.values())) >= 0.95
    # residency: nobody leaves before min_residency_steps
    candidates = [Candidate(str(i), i, 1e9 if i == 0 else 0.0, i == 0, 1, False) for i in range(3)]
    assert "0" in choose_residents(candidates, 1, min_residency_steps=3)
    # a higher priority first; among equals, tokens per unit of share
    candidates = [
        Candidate("low", 0, 0.0, False, 0, False, priority=0),
        Candidate("high", 1, 1e6, False, 0, False, priority=1),
        Candidate("double", 2, 150.0, False, 0, False, share=2.0),
        Candidate("single", 3, 100.0, False, 0, False),
    ]
    assert choose_residents(candidates, 3, min_residency_steps=1) == ["high", "low", "double"]
    # a DRAINING adapter gets a slot whatever its share (it must checkpoint)
    candidates = [Candidate("d", 5, 1e9, False, 0, True), Candidate("x", 1, 0.0, False, 0, False)]
    assert choose_residents(candidates, 1, min_residency_steps=3) == ["d"]


def test_the_core_hands_slots_over_and_a_restart_keeps_adapters_running(tmp_path: Path) -> None:
    policy = ResidencyPolicy(max_running=4, min_residency_steps=2)
    core = ControllerCore(num_slots=2, max_rank=8, state_dir=tmp_path, residency=policy)
    for i in range(5):
        core.register(adapter(f"x{i}", 10))
    snap = core.snapshot()
    assert [a.name for a in snap.running] == ["x0", "x1"] and snap.parked == ("x2", "x3")
    assert core.get("x4")["state"] == "PENDING"  # max_running
    for _ in range(2):  # two steps: x0 and x1 served their minimum residency
        result = AdapterResult(True, None, None, {"trained_tokens": 100})
        core.report_step({a.name: result for a in snap.running})
        snap = core.snapshot()
    assert sorted(a.name for a in snap.running) == ["x2", "x3"]  # the least served get the slots
    assert set(snap.parked) == {"x0", "x1"} and not snap.slots_to_clear  # handed over at once
    assert all(a.needs_init for a in snap.running)
    restored = ControllerCore.restore(tmp_path, num_slots=2, max_rank=8, residency=policy)
    assert {r["name"]: r["state"] for r in restored.list()} == {
        "x0": "RUNNING", "x1": "RUNNING", "x2": "RUNNING", "x3": "RUNNING", "x4": "PENDING"
    }  # fmt: skip
    again = restored.snapshot()
    assert len(again.running) == 2 and len(again.parked) == 2
    assert all(a.needs_init for a in again.running)  # from their last checkpoints


def test_the_adapters_table_shows_parked_queued_and_each_share() -> None:
    from rich.console import Console

    from miles_multilora.controller.commands import adapters_table

    policy = ResidencyPolicy(max_running=2, min_residency_steps=1)
    core = ControllerCore(num_slots=1, max_rank=8, residency=policy)
    for i in range(3):
        core.register(adapter(f"x{i}", 10))
    snap = core.snapshot()
    core.report_step({snap.running[0].name: AdapterResult(True, None, None, {"trained_tokens": 30})})
    console = Console(width=200, record=True)
    console.print(adapters_table(core.list()))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "│" in line}
    assert "100%" in rows["x0"] and " 0 " in rows["x0"]  # in slot 0, all the tokens trained so far
    assert "parked" in rows["x1"] and "0%" in rows["x1"]
    assert "queued #1" in rows["x2"]


def test_each_snapshot_names_the_next_turn_ahead(tmp_path: Path) -> None:
    """The parked adapters a snapshot names as the next turn are the ones the next snapshot brings in
    when every adapter trains the same tokens each step; none while the residents must stay."""
    policy = ResidencyPolicy(max_running=6, min_residency_steps=2)
    core = ControllerCore(num_slots=2, max_rank=8, state_dir=tmp_path, residency=policy)
    tokens = {f"x{i}": 100 + 10 * i for i in range(6)}
    for name in tokens:
        core.register(adapter(name, 10))
    snap = core.snapshot()
    assert snap.next_turn == ()  # x0 and x1 must serve two steps
    named = 0
    for _ in range(10):
        core.report_step({a.name: AdapterResult(True, None, None, {"trained_tokens": tokens[a.name]})
                          for a in snap.running})  # fmt: skip
        resident = {a.name for a in snap.running}
        predicted, snap = snap.next_turn, core.snapshot()
        assert set(predicted) == {a.name for a in snap.running} - resident
        named += len(predicted)
    assert named >= 8  # five handovers of two in ten steps
