"""More adapters RUNNING than slots (tiny model, in process, the real controller core): they take
turns, a parked adapter comes back exactly where it left (weights, optimizer, data position), all
reach DONE."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_multilora.controller import ControllerCore
from miles_multilora.controller.residency import ResidencyPolicy
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from tests.e2e.conftest import tiny_run_config, toy_adapter
from tests.helpers import assert_close_at_scale
from tests.unit.test_rl_step import drive

STEPS = 3
NAMES = ("a0", "a1", "a2", "a3", "a4")


def _run(
    tmp_path: Path, names: tuple[str, ...], slots: int, turns: bool, offload_gb: float = 16.0, **rollout: int
) -> tuple[list, dict]:
    specs = [toy_adapter(n, "fraction_of_lowercase", steps=STEPS) for n in names]
    cfg = tiny_run_config(
        tmp_path, specs, lora={"num_slots": slots, "max_rank": 8}, rollout=rollout,
        trainer={"offload_host_gb": offload_gb},
    )  # fmt: skip
    policy = ResidencyPolicy(max_running=len(names), min_residency_steps=1) if turns else None
    core = ControllerCore(num_slots=slots, max_rank=8, residency=policy)
    for spec in specs:
        core.register(spec)
    worker = RLStep.build(cfg)
    snapshots, finals = [], {}
    try:
        for _ in range(12 * STEPS):
            snapshots.append(core.snapshot())
            core._snapshot_id -= 1  # drive() takes the same snapshot again
            if drive(core, [worker]) is None:
                break
        for name in names:
            record = core.get(name)
            assert record["state"] == "DONE", (name, record["state"], record["reason"])
            final = torch.load(Path(record["last_checkpoint"]) / "slot_rank0.pt", weights_only=True)
            finals[name] = final
    finally:
        compat.destroy_distributed()
    return snapshots, finals


def test_five_adapters_take_turns_in_two_slots_and_train_like_residents(tmp_path: Path) -> None:
    snapshots, finals = _run(tmp_path / "turns", NAMES, slots=2, turns=True, offload_gb=0.0)  # via disk
    assert not any((tmp_path / "turns" / "offload").rglob("slot_rank0.pt"))  # restored spills are gone
    assert max(len(s.running) + len(s.draining) for s in snapshots) == 2
    assert any(s.parked for s in snapshots)  # some adapters waited parked while others trained
    for name in NAMES:  # each one was resident in more than one stretch: it was parked and came back
        held = [any(a.name == name for a in s.adapters) for s in snapshots]
        stretches = sum(1 for i, h in enumerate(held) if h and (i == 0 or not held[i - 1]))
        assert stretches >= 2, (name, held)
    _, alone = _run(tmp_path / "resident", NAMES, slots=len(NAMES), turns=False)
    # parked and restored (weights, moments, data position): the same training. Not bit for bit:
    # batches of 2 adapters and of 5 sum the same terms in another order (the park itself is
    # exact: tests/unit/test_slot_offload.py)
    for name in NAMES:
        for key, value in alone[name]["slot"].items():
            assert_close_at_scale(finals[name]["slot"][key], value, 1e-4, f"{name} {key}")


def test_turns_with_continuous_rollout_put_prompts_in_flight_back(tmp_path: Path) -> None:
    snapshots, finals = _run(tmp_path, NAMES, slots=2, turns=True, max_staleness=1)
    assert any(s.parked for s in snapshots)
    assert all(final["meta"]["version"] == STEPS for final in finals.values())


def test_a_tenant_over_its_tokens_per_hour_waits_parked_and_trains_on_exactly(tmp_path: Path) -> None:
    """Both adapters of tenant ``t`` pass its tokens_per_hour at every step: the slots idle, the
    trainer parks them in a step of no adapter (``loop.must_step``, as the driver loop runs it), and
    once the hour has slid they come back where they were and train like adapters never held back."""
    from miles_multilora.config.quotas import TenantQuota
    from miles_multilora.controller.quotas import BUCKET_S, WINDOW_S, TenantQuotas
    from miles_multilora.launch.loop import must_step

    now = [1_000_000.0]
    names = NAMES[:2]
    specs = [toy_adapter(n, "fraction_of_lowercase", steps=STEPS, tenant="t") for n in names]
    cfg = tiny_run_config(tmp_path / "quota", specs, lora={"num_slots": 2, "max_rank": 8})
    quotas = TenantQuotas(tenants={"t": TenantQuota(tokens_per_hour=1)})
    policy = ResidencyPolicy(min_residency_steps=1, quotas=quotas)
    core = ControllerCore(num_slots=2, max_rank=8, residency=policy, clock=lambda: now[0])
    for spec in specs:
        core.register(spec)
    worker = RLStep.build(cfg)
    held: set[str] = set()
    idle = parking_steps = 0
    try:
        for _ in range(6 * STEPS):
            snap = core.snapshot()
            if not must_step(snap, held):
                if all(core.get(n)["state"] == "DONE" for n in names):
                    break
                assert core.get(names[0])["quota"]["limit"] == "tokens_per_hour"
                idle += 1
                now[0] += WINDOW_S + BUCKET_S  # the hour slides
                continue
            parking_steps += not snap.adapters and bool(snap.parked)
            core._snapshot_id -= 1  # drive() takes the same snapshot again
            drive(core, [worker])
            held = {a.name for a in snap.adapters}
        finals = {}
        for name in names:
            record = core.get(name)
            assert record["state"] == "DONE", (name, record["state"], record["reason"])
            assert record["parked_s"] >= (STEPS - 1) * WINDOW_S
            finals[name] = torch.load(Path(record["last_checkpoint"]) / "slot_rank0.pt", weights_only=True)
    finally:
        compat.destroy_distributed()
    assert idle == STEPS - 1 and parking_steps == STEPS - 1
    _, alone = _run(tmp_path / "free", names, slots=2, turns=False)
    for name in names:
        for key, value in alone[name]["slot"].items():
            assert_close_at_scale(finals[name]["slot"][key], value, 1e-4, f"{name} {key}")
