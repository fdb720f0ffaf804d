"""The adapter-version lifecycle both HTTP engines share (SGLang and vLLM), against their stand-in
servers (real HTTP servers on 127.0.0.1): the bound on loaded versions, in-flight requests across an
unload, server restarts, refused loads, stale copies, exports and the per-step counters."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.rollout import AdapterVersion, GenerationRequest, RolloutError, SGLangEngine, VLLMEngine
from miles_multilora.rollout.remote_engine import RemoteEngine
from tests.standins.lora_standin import LoRAStandIn
from tests.standins.sglang_standin import SGLangStandIn
from tests.standins.vllm_standin import VLLMStandIn

SAMPLING = SamplingSpec(temperature=1.0, max_new_tokens=4)


@pytest.fixture(scope="module")
def standins():
    with SGLangStandIn() as s1, SGLangStandIn() as s2, VLLMStandIn() as v1, VLLMStandIn() as v2:
        yield {"sglang": (s1, s2), "vllm": (v1, v2)}


class Kit:
    """One engine kind's servers (reset), an engine factory and PEFT exports under ``root``."""

    def __init__(self, kind: str, servers: tuple[LoRAStandIn, ...], root: Path) -> None:
        self.kind, self.servers, self.root = kind, servers, root
        for server in servers:
            server.reset()

    def engine(self, n_servers: int = 1, **kwargs: Any) -> RemoteEngine:
        urls = [s.url for s in self.servers[:n_servers]]
        cls: Callable[..., RemoteEngine] = SGLangEngine if self.kind == "sglang" else VLLMEngine
        return cls(urls, timeout_s=10, **kwargs)

    def path(self, adapter: str, version: int, tag: str = "") -> Path:
        return self.root / "sync" / adapter / f"v{version:06d}{tag}"

    def export(self, adapter: str, version: int, tag: str = "") -> str:
        path = self.path(adapter, version, tag)
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
        return str(path)

    def update(self, engine: RemoteEngine, **versions: int) -> None:
        engine.update_adapters(
            {a: AdapterVersion(slot, v, self.export(a, v)) for slot, (a, v) in enumerate(versions.items())}
        )


@pytest.fixture(params=["sglang", "vllm"])
def kit(request, standins, tmp_path) -> Kit:
    return Kit(request.param, standins[request.param], tmp_path)


def _req(adapter: str, slot: int, version: int, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(adapter, slot, version, [3, 4, 5], SAMPLING, seed=seed)


@pytest.mark.parametrize("bound, steps", [(2, 200), (1, 50)])
def test_loaded_versions_never_exceed_the_bound_over_200_steps(kit, bound, steps):
    engine = kit.engine(n_servers=2, max_versions_per_adapter=bound)
    server = kit.servers[0]
    peaks = []
    last = steps - 1
    for step in range(steps):
        kit.update(engine, a=step, b=step)
        results = engine.generate([_req("a", 0, step, seed=step), _req("b", 1, step, seed=step)])
        assert [r.tag for r in results] == [("a", step), ("b", step)]
        peaks.append(engine.step_stats()["lora_versions_peak"])
    assert max(peaks) == bound and max(n for s in kit.servers for n in s.peak_versions.values()) == bound
    held = {name for s in kit.servers for name in s.loaded}
    assert held == {f"a@v{last}", f"b@v{last}"}  # one version each between steps
    unloads = Counter(name for s in kit.servers for kind, name in s.events if kind == "unload")
    loads = Counter(name for s in kit.servers for kind, name in s.events if kind == "load")
    assert all(unloads[name] == loads[name] for name in loads if not name.endswith(f"@v{last}"))  # once
    assert len(server.served) >= steps and set(server.served) <= {
        f"{a}@v{v}" for a in "ab" for v in range(steps)
    }


def test_a_request_in_flight_during_an_unload_completes_on_its_own_version(kit):
    engine = kit.engine(max_versions_per_adapter=2)
    server = kit.servers[0]
    kit.update(engine, a=1)
    server.hold()
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(engine.generate([_req("a", 0, 1, seed=5)])))
    worker.start()
    try:
        server.wait_in_flight(1)
        kit.update(engine, a=2)  # v1 is replaced but still serves its request
        kit.update(engine, a=3)  # the idle v2 goes to make room; v1 still in flight
        assert set(server.loaded) == {"a@v1", "a@v3"} and ("unload", "a@v1") not in server.events
        with pytest.raises(RolloutError, match="version 1"):
            engine.check_request(_req("a", 0, 1))  # no new request gets the old version
    finally:
        server.release()
        worker.join(timeout=10)
    [[result]] = out
    assert result.tag == ("a", 1) and server.served == ["a@v1"]
    assert server.events.count(("unload", "a@v1")) == 1 and set(server.loaded) == {"a@v3"}
    assert server.peak_versions["a"] == 2


def test_with_one_version_an_update_waits_for_the_old_versions_requests(kit):
    engine = kit.engine(max_versions_per_adapter=1)
    server = kit.servers[0]
    kit.update(engine, a=1)
    server.hold()
    worker = threading.Thread(target=engine.generate, args=([_req("a", 0, 1)],))
    worker.start()
    server.wait_in_flight(1)
    updater = threading.Thread(target=kit.update, args=(engine,), kwargs={"a": 2})
    updater.start()
    updater.join(timeout=0.3)
    assert updater.is_alive() and set(server.loaded) == {"a@v1"}  # waiting: no room for v2 yet
    server.release()
    worker.join(timeout=10)
    updater.join(timeout=10)
    assert server.events == [("load", "a@v1"), ("unload", "a@v1"), ("load", "a@v2")]
    stats = engine.step_stats()
    assert stats["lora_waits"] == 1 and stats["lora_versions_peak"] == 1


def test_a_server_restart_mid_run_reloads_what_is_needed_and_nothing_stale_is_served(kit):
    engine = kit.engine(n_servers=2)
    kit.update(engine, a=1, b=1)
    engine.generate([_req("a", 0, 1), _req("b", 1, 1)])
    engine.step_stats()
    for server in kit.servers:
        server.restart()
    before = [len(s.served) for s in kit.servers]
    results = engine.generate([_req("a", 0, 1, seed=s) for s in range(4)] + [_req("b", 1, 1)])
    assert {r.tag for r in results} == {("a", 1), ("b", 1)}
    assert engine.step_stats()["lora_reloads"] >= 2  # each needed version, on the servers that serve it
    kit.update(engine, a=2, b=2)  # the old versions, lost or reloaded, go; the new ones load
    results = engine.generate([_req("a", 0, 2), _req("b", 1, 2)])
    assert {r.tag for r in results} == {("a", 2), ("b", 2)}
    assert {n for s in kit.servers for n in s.loaded} == {"a@v2", "b@v2"}
    after = [s.served[k:] for s, k in zip(kit.servers, before, strict=True)]
    assert {n for names in after for n in names} == {"a@v1", "b@v1", "a@v2", "b@v2"}  # each its own
    assert all([n[-1] for n in names] == sorted(n[-1] for n in names) for names in after)  # v1, then v2


def test_a_new_trainer_process_never_trusts_what_an_earlier_one_left_loaded(kit):
    server = kit.servers[0]
    earlier = kit.engine()
    kit.update(earlier, a=1)
    kit.update(earlier, a=2)  # then the trainer dies; the server keeps a@v2 from the old export
    resumed = kit.engine()  # the new process re-exports v2 (a rewind) at another path
    resumed.update_adapters({"a": AdapterVersion(0, 2, kit.export("a", 2, tag="-rewound"))})
    assert server.loaded == {"a@v2": kit.export("a", 2, tag="-rewound")}  # replaced, not reused
    assert resumed.step_stats()["lora_replaced"] >= 1
    [res] = resumed.generate([_req("a", 0, 2)])
    assert res.tag == ("a", 2)


def test_vllm_checks_each_served_version_against_the_servers_list(standins, tmp_path):
    kit = Kit("vllm", standins["vllm"], tmp_path)
    engine, server = kit.engine(), kit.servers[0]
    kit.update(engine, a=1)
    with server._lock:  # another party replaced a@v1 on the server with other weights
        server.loaded["a@v1"] = kit.export("a", 1, tag="-other")
    engine.generate([_req("a", 0, 1)])
    assert server.loaded["a@v1"] == kit.export("a", 1) and engine.step_stats()["lora_reloads"] == 1


@pytest.mark.parametrize(
    "switch, flag",
    [
        ({"lora_enabled": False}, "--enable-lora"),
        ({"max_loras": 0}, "--max-lo"),  # vLLM --max-loras, SGLang --max-loaded-loras
        ({"refuse": {"b": "LoRA rank 64 is greater than max_lora_rank 16."}}, "--max-lora-rank"),
    ],
    ids=["no-lora", "slots-full", "rank"],
)
def test_a_refused_load_fails_that_adapter_with_the_server_flag_and_the_others_go_on(kit, switch, flag):
    engine = kit.engine()
    server = kit.servers[0]
    kit.update(engine, a=1)
    for key, value in switch.items():
        setattr(server, key, value)
    if "max_loras" in switch:
        server.max_loras = len(server.loaded)  # full
    kit.update(engine, a=1, b=1)  # a is unchanged, b new
    assert engine.adapter_versions() == {"a": 1}
    failures = engine.load_failures()
    assert list(failures) == ["b"] and flag in failures["b"]
    with pytest.raises(RolloutError, match=flag):
        engine.check_request(_req("b", 1, 1))  # the trainer fails b alone (test_train_vllm.py)
    [res] = engine.generate([_req("a", 0, 1)])  # the other adapter is served on
    assert res.tag == ("a", 1)
    assert engine.step_stats()["lora_load_failures"] == 1
    server.reset()
    kit.update(engine, a=2, b=2)  # the next version of b loads again
    assert engine.adapter_versions() == {"a": 2, "b": 2} and engine.load_failures() == {}


def test_vllm_without_runtime_lora_updating_names_the_switch(standins, tmp_path):
    kit = Kit("vllm", standins["vllm"], tmp_path)
    engine = kit.engine()
    kit.servers[0].runtime_updates = False
    kit.update(engine, a=1)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in engine.load_failures()["a"]


def test_a_load_the_server_cannot_take_yet_is_retried(kit):
    engine = kit.engine()
    server = kit.servers[0]
    engine.versions.retry_backoff_s = 0.01
    server.fail_next_loads = 2
    kit.update(engine, a=1)
    assert engine.adapter_versions() == {"a": 1} and server.loaded == {"a@v1": kit.export("a", 1)}
    assert engine.step_stats()["lora_load_retries"] == 2
    server.fail_next_loads = 5
    kit.update(engine, a=2)
    assert "503" in engine.load_failures()["a"] and server.loaded == {}  # v1 retired too: nothing stale


def test_unloaded_versions_exports_are_deleted_and_the_counters_cover_the_step(kit):
    engine = kit.engine(export_root=str(kit.root / "sync"))
    kit.update(engine, a=1)
    first = engine.step_stats()
    assert first["lora_loads"] == 1 and first["lora_unloads"] == 0 and first["lora_load_ms"] > 0
    kit.update(engine, a=2)
    stats = engine.step_stats()
    assert stats["lora_loads"] == 1 and stats["lora_unloads"] == 1 and stats["lora_versions_peak"] == 2
    assert not kit.path("a", 1).exists() and kit.path("a", 2).exists()
    engine.remove_adapters(["a"])
    assert not kit.path("a", 2).exists() and kit.servers[0].loaded == {}
    assert engine.step_stats()["lora_loads"] == 0  # counters are per step


def test_data_parallel_clients_one_manages_the_other_repairs_after_a_restart(kit):
    manager = kit.engine(manages_adapters=True)
    other = kit.engine(manages_adapters=False, first_server=1)
    server = kit.servers[0]
    for engine in (manager, other):
        kit.update(engine, a=1)
    assert server.events == [("load", "a@v1")]  # the other rank only tracks the version
    server.restart()
    [res] = other.generate([_req("a", 0, 1)])  # a DP rank finds the version lost and loads it again
    assert res.tag == ("a", 1) and server.events[-1] == ("load", "a@v1")
    for engine in (manager, other):
        kit.update(engine, a=2)
    assert server.loaded == {"a@v2": kit.export("a", 2)} and server.events.count(("unload", "a@v1")) == 1
