"""Per-tenant quotas in the real controller core (no Ray, a clock the test moves): a tenant at its
max_running waits PENDING while other tenants' later adapters are admitted; a tenant past its
tokens_per_hour gets no turn in the slots until the hour slides (and a restart keeps the window);
queue times grow while an adapter waits and stand still once it runs; a priority above the tenant's
bound is refused; bad quotas name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
from rich.console import Console

from miles_multilora.config.quotas import TenantQuota
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.commands import adapters_table
from miles_multilora.controller.http_api import ControllerHTTPServer
from miles_multilora.controller.quotas import BUCKET_S, WINDOW_S, TenantQuotas
from miles_multilora.controller.residency import ResidencyPolicy
from miles_multilora.controller.snapshot import AdapterResult
from miles_multilora.errors import ConfigError, SpecError


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def spec(name: str, tenant: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 50}
    return out if tenant is None else {**out, "tenant": tenant}


def quotas(default: TenantQuota | None = None, **tenants: TenantQuota) -> TenantQuotas:
    return TenantQuotas(default or TenantQuota(), tenants)


def records(core: ControllerCore) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in core.list()}


def table_rows(rows: Any) -> dict[str, str]:
    """The rows of the adapters table as printed, by adapter name."""
    console = Console(width=250, record=True)
    console.print(adapters_table(list(rows)))
    return {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "│" in line}


def step(core: ControllerCore, tokens: dict[str, float]) -> dict[str, dict[str, float]]:
    return core.report_step(
        {n: AdapterResult(True, None, None, {"trained_tokens": t}) for n, t in tokens.items()}
    )


@pytest.mark.parametrize("turns", [False, True], ids=["one_per_slot", "taking_turns"])
def test_a_tenant_at_max_running_waits_while_another_tenants_later_adapter_runs(turns: bool) -> None:
    policy = ResidencyPolicy(max_running=4 if turns else None, min_residency_steps=1,
                             quotas=quotas(alice=TenantQuota(max_running=1)))  # fmt: skip
    core = ControllerCore(num_slots=2 if turns else 3, max_rank=16, residency=policy)
    core.register(spec("a1", "alice"))
    core.register(spec("a2", "alice"))
    core.register(spec("b1", "bob"))  # later than a2, another tenant
    core.register(spec("c1"))  # its own tenant (its name): no quota
    core.snapshot()
    state = records(core)
    assert {n: r["state"] for n, r in state.items()} == {
        "a1": "RUNNING", "a2": "PENDING", "b1": "RUNNING", "c1": "RUNNING"
    }  # fmt: skip
    assert [state[n]["tenant"] for n in ("a1", "a2", "b1", "c1")] == ["alice", "alice", "bob", "c1"]
    assert state["a2"]["quota"] == {
        "tenant": "alice", "limit": "max_running", "value": 1, "used": 1, "resumes_in_s": None
    }  # fmt: skip
    assert state["b1"]["quota"] is None and state["a2"]["reason"] is None  # queued, never failed
    if turns:  # what `miles-multilora list` and the HTTP API show
        assert "queued #1 (tenant at max_running 1)" in table_rows(state.values())["a2"]
        server = ControllerHTTPServer(core, port=0)
        try:
            over_http = {
                r["name"]: r
                for r in requests.get(f"{server.start()}/adapters", timeout=10).json()["adapters"]
            }
        finally:
            server.stop()
        assert over_http["a2"]["quota"] == state["a2"]["quota"] and over_http["a2"]["tenant"] == "alice"
        assert {"pending_s", "parked_s"} <= set(over_http["a2"])
    core.mark_done("a1")
    for slot in core.snapshot().slots_to_clear:
        core.slot_cleared(slot)
    core.snapshot()
    assert core.get("a2")["state"] == "RUNNING" and core.get("a2")["quota"] is None


def test_over_tokens_per_hour_gets_no_turn_until_the_window_slides_and_a_restart_keeps_it(
    tmp_path: Path,
) -> None:
    clock = Clock()
    limits = quotas(TenantQuota(tokens_per_hour=10_000), alice=TenantQuota(tokens_per_hour=1000))
    policy = ResidencyPolicy(min_residency_steps=4, quotas=limits)  # turns without max_running
    core = ControllerCore(num_slots=2, max_rank=16, state_dir=tmp_path, residency=policy, clock=clock)
    core.register(spec("a", "alice"))
    core.register(spec("b", "bob"))
    assert [x.name for x in core.snapshot().running] == ["a", "b"]
    step(core, {"a": 600, "b": 100})
    clock.now += 60
    assert [x.name for x in core.snapshot().running] == ["a", "b"]  # 600 < 1000
    step(core, {"a": 600, "b": 100})
    clock.now += 60
    snap = core.snapshot()  # alice: 1200 in the hour; parked at once, even within min_residency_steps
    assert [x.name for x in snap.running] == ["b"] and snap.parked == ("a",)
    note = core.get("a")["quota"]
    assert (note["limit"], note["value"], note["used"]) == ("tokens_per_hour", 1000, 1200)
    assert WINDOW_S - 120 < note["resumes_in_s"] <= WINDOW_S + BUCKET_S
    assert core.get("a")["state"] == "RUNNING" and core.get("a")["reason"] is None
    assert "parked (tenant over tokens_per_hour 1000; ~58m)" in table_rows(core.list())["a"]

    restored = ControllerCore.restore(tmp_path, num_slots=2, max_rank=16, residency=policy, clock=clock)
    snap = restored.snapshot()
    assert [x.name for x in snap.running] == ["b"] and snap.parked == ("a",)  # the window survived
    clock.now += 600
    step(restored, {"b": 10_000})  # now bob is over too: every RUNNING adapter is, the slots idle
    clock.now += 60
    snap = restored.snapshot()
    assert snap.running == () and set(snap.parked) == {"a", "b"}
    clock.now += 1800
    assert restored.snapshot().running == ()  # half an hour later: still in the window
    clock.now = 1_000_000.0 + 120 + WINDOW_S + BUCKET_S  # alice's minutes left the window
    snap = restored.snapshot()
    assert [(x.name, x.needs_init) for x in snap.running] == [("a", True)]
    assert restored.get("a")["quota"] is None and restored.get("b")["quota"]["limit"] == "tokens_per_hour"


def test_queue_times_grow_while_waiting_and_stand_still_once_running() -> None:
    clock = Clock()
    policy = ResidencyPolicy(max_running=3, min_residency_steps=1)
    core = ControllerCore(num_slots=1, max_rank=16, residency=policy, clock=clock)
    for name in ("x", "y", "z", "w"):
        core.register(spec(name))
    core.snapshot()  # x in the slot, y and z parked, w PENDING (max_running)
    clock.now += 30
    core.snapshot()
    times = {n: (r["pending_s"], r["parked_s"]) for n, r in records(core).items()}
    assert times == {"x": (0, 0), "y": (0, 30), "z": (0, 30), "w": (30, 0)}
    assert core.list() == core.list()  # a read changes nothing: times move with the scheduling passes
    queue = step(core, {"x": 100})
    assert queue["x"] == {"queue/pending_s": 0, "queue/parked_s": 0}
    clock.now += 10
    core.snapshot()  # y (least served, first registered) takes the slot
    clock.now += 5
    assert step(core, {"y": 100})["y"] == {"queue/pending_s": 0, "queue/parked_s": 40}
    assert core.get("y")["metrics"][-1]["queue/parked_s"] == 40  # in its metrics, for the log
    core.cancel("x")  # DRAINING gets a slot back (to checkpoint) at once; w waits until x ends
    core.snapshot()
    core.drained("x")
    clock.now += 5
    core.snapshot()  # w is admitted (x's slot waits to be cleared: everyone is parked)
    clock.now += 100
    core.snapshot()
    state = records(core)
    assert (state["w"]["state"], state["w"]["pending_s"], state["w"]["parked_s"]) == ("RUNNING", 50, 100)
    assert state["x"]["state"] == "CANCELLED" and state["x"]["parked_s"] == 5  # frozen at its end
    assert state["z"]["parked_s"] == 150 and state["y"]["parked_s"] == 40 + 105


def test_a_priority_above_the_tenants_bound_is_refused_naming_the_setting() -> None:
    policy = ResidencyPolicy(quotas=quotas(vip=TenantQuota(max_priority=50)))
    core = ControllerCore(num_slots=1, max_rank=16, residency=policy)
    for name, tenant, priority, setting in (
        ("greedy", None, 100, "controller.default_tenant_quota.max_priority"),  # default bound: 0
        ("pushy", "team-a", 1, "controller.default_tenant_quota.max_priority"),
        ("vip-max", "vip", 51, "controller.tenant_quotas.vip.max_priority"),
    ):
        with pytest.raises(SpecError) as info:
            core.register({**spec(name, tenant), "priority": priority})
        assert info.value.key == "priority" and setting in info.value.message
    assert core.list() == []  # nothing registered
    assert core.register({**spec("polite", "team-a"), "priority": -5})["spec"]["priority"] == -5
    assert core.register({**spec("ok", "team-a"), "priority": 0})["state"] == "PENDING"
    assert core.register({**spec("vip-a", "vip"), "priority": 50})["spec"]["priority"] == 50


def test_bad_quotas_and_tenants_name_the_key(tmp_path: Path) -> None:
    from miles_multilora.config.run import config_from_container, load_run_config

    def refused(controller: dict[str, Any], tinker: dict[str, Any] | None = None) -> str:
        with pytest.raises(ConfigError) as info:
            config_from_container(
                {"model": {"source": "tiny"}, "controller": controller, "tinker": tinker or {}}
            )
        return info.value.key

    for controller, key in (
        ({"tenant_quotas": {"alice": {"max_running": -1}}}, "controller.tenant_quotas.alice.max_running"),
        (
            {"default_tenant_quota": {"tokens_per_hour": -5}},
            "controller.default_tenant_quota.tokens_per_hour",
        ),
        ({"tenant_quotas": {"bad name": {"max_running": 1}}}, "controller.tenant_quotas.bad name"),
        ({"tenant_quotas": {"alice": {"max_runing": 1}}}, "controller.tenant_quotas.alice.max_runing"),
        ({"tenant_quotas": {"alice": 3}}, "controller.tenant_quotas.alice"),
        ({"tenant_quotas": {"alice": {"max_priority": 101}}}, "controller.tenant_quotas.alice.max_priority"),
        ({"default_tenant_quota": {"max_priority": -101}}, "controller.default_tenant_quota.max_priority"),
    ):
        assert refused(controller) == key
    assert refused({}, {"max_models": 8, "max_models_per_tenant": 0}) == "tinker.max_models_per_tenant"
    with pytest.raises(ConfigError) as info:
        TenantQuotas(tenants={"alice": TenantQuota(tokens_per_hour=-1)})
    assert info.value.key == "controller.tenant_quotas.alice.tokens_per_hour"
    cfg = load_run_config("service", ["model=tiny", "+controller.tenant_quotas.alice.max_running=2",
                                      "controller.default_tenant_quota.tokens_per_hour=5000"])  # fmt: skip
    assert cfg.controller.tenant_quotas["alice"] == TenantQuota(max_running=2)
    assert cfg.controller.default_tenant_quota.tokens_per_hour == 5000
    core = ControllerCore(num_slots=1, max_rank=16)
    with pytest.raises(SpecError) as spec_info:
        core.register(spec("a", "../etc"))
    assert spec_info.value.key == "tenant" and core.list() == []
    assert "tenant" not in core.register(spec("plain"))["spec"]  # a spec without one serialises as before


def test_a_restart_with_a_lower_max_running_requeues_the_tenants_newest(tmp_path: Path) -> None:
    core = ControllerCore(num_slots=3, max_rank=16, state_dir=tmp_path)
    for name in ("a1", "a2", "b1"):
        core.register(spec(name, "alice" if name.startswith("a") else "bob"))
    core.snapshot()
    policy = ResidencyPolicy(quotas=quotas(alice=TenantQuota(max_running=1)))
    restored = ControllerCore.restore(tmp_path, num_slots=3, max_rank=16, residency=policy)
    assert {n: r["state"] for n, r in records(restored).items()} == {
        "a1": "RUNNING", "a2": "PENDING", "b1": "RUNNING"
    }  # fmt: skip
    assert [a.name for a in restored.snapshot().running] == ["a1", "b1"]
    assert restored.get("a2")["quota"]["limit"] == "max_running"
