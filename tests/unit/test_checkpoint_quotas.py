"""What one tenant's checkpoints may take from the others: a byte quota per tenant on both doors
(counting only what retention keeps), a floor of free disk, refusals that name the setting and
leave no file behind; the Tinker catalog indexed per tenant, so one tenant's slow writes never hold
another's list or save."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_multilora.config.adapter import OptimizerSpec, parse_adapter_spec
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.controller.snapshot import SlotAssignment
from miles_multilora.disk_usage import dir_size
from miles_multilora.rl import checkpoint as ckpt
from miles_multilora.rl import checkpoint_layout as layout
from miles_multilora.rl import checkpoint_quota
from miles_multilora.rl.checkpoint_quota import DiskLimits
from miles_multilora.tinker import catalog as catalog_module
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue
from miles_multilora.tinker.catalog import SAMPLER, TRAINING, Catalog
from miles_multilora.tinker.requests import TinkerError
from miles_multilora.tinker.state import ServerState
from tests.fake_rank import FakeRank

NO_ROOM = 1 << 62  # more free bytes than any disk has


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


class Adapters:
    """Adapters in the slots of one fake rank, checkpointed by the real writer."""

    def __init__(self, out: Path, keep: int = 2) -> None:
        self.rank, self.out, self.keep, self.open = FakeRank(num_slots=4), out, keep, {}

    def add(self, name: str, tenant: str | None) -> None:
        slot = len(self.open)
        spec = {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 9}
        spec = parse_adapter_spec(spec if tenant is None else {**spec, "tenant": tenant})
        self.rank.open_slot(slot, 4, 8.0, 0, OptimizerSpec(), name)
        self.open[name] = SlotAssignment(name, f"{name}-1", slot, spec, 0, None, True)

    def save(self, name: str, step: int, limits: DiskLimits) -> ckpt.SavedCheckpoint:
        assignment = self.open[name]
        self.rank.slots[assignment.slot].version = step
        return ckpt.write_checkpoint(self.rank, self.out, assignment, {}, self.keep, limits)


@pytest.fixture(autouse=True)
def fresh_usage() -> Iterator[None]:
    checkpoint_quota._USAGE.clear()  # each test is its own trainer process
    yield
    checkpoint_quota._USAGE.clear()


def test_a_tenants_checkpoints_stay_within_its_byte_quota_counting_what_retention_keeps(
    tmp_path: Path,
) -> None:
    probe = Adapters(tmp_path / "probe")
    probe.add("p", None)
    one = dir_size(probe.save("p", 1, DiskLimits()))  # the bytes of one checkpoint of these adapters

    adapters = Adapters(tmp_path / "out", keep=2)
    for name, tenant in (("a", "team"), ("b", "team"), ("c", None)):
        adapters.add(name, tenant)
    limits = DiskLimits(max_bytes_per_tenant=int(2.5 * one))
    for step in (1, 2, 3, 4):  # retention keeps two: the tenant stays under its quota
        saved = adapters.save("a", step, limits)
    run = layout.run_dir(tmp_path / "out", "a", "a-1")
    assert [p.name for p in layout.complete_checkpoints(run)] == ["step_000003", "step_000004"]
    assert saved.tenant_bytes == dir_size(run)  # what the step's metrics show (checkpoint/tenant_bytes)

    with pytest.raises(ckpt.CheckpointError) as info:  # a third checkpoint of the same tenant
        adapters.save("b", 1, limits)
    message = str(info.value)
    assert "trainer.max_checkpoint_bytes_per_tenant" in message and "'team'" in message
    assert files_under(tmp_path / "out" / "checkpoints" / "b") == []  # nothing half saved is left
    assert adapters.save("c", 1, limits).tenant_bytes < 2 * one  # another tenant has its own quota

    checkpoint_quota._USAGE.clear()  # a restarted trainer learns the usage back from the disk
    with pytest.raises(ckpt.CheckpointError, match="max_checkpoint_bytes_per_tenant"):
        adapters.save("b", 2, limits)
    assert adapters.save("a", 5, limits).tenant_bytes == dir_size(run)  # replacing its oldest fits

    with pytest.raises(ckpt.CheckpointError, match="trainer.min_free_disk_bytes") as info:
        adapters.save("c", 2, DiskLimits(min_free_bytes=NO_ROOM))
    assert "nothing was saved" in str(info.value)
    assert [p.name for p in layout.complete_checkpoints(layout.run_dir(tmp_path / "out", "c", "c-1"))] == [
        "step_000001"
    ]
    assert not list((tmp_path / "out" / "checkpoints").rglob(".tmp-*"))


def staged(c: Catalog, tenant: str, run: str, kind: str, name: str, size: int) -> Path:
    staging = c.staging_of(tenant, run, kind, name)
    staging.mkdir()
    (staging / "f").write_bytes(b"x" * size)
    return staging


def put(c: Catalog, tenant: str, kind: str, name: str, size: int) -> int | None:
    """Save ``size`` bytes as the tenant's checkpoint ``<kind>/<name>`` (of its run ``run-<tenant>``)."""
    run = f"run-{tenant}"
    staging = staged(c, tenant, run, kind, name, size)
    return c.put(tenant, run, kind, name, staging, ttl_s=None, user_metadata=None).size_bytes


def test_the_tinker_catalog_refuses_a_save_past_the_tenants_bytes_or_the_disk_floor(tmp_path: Path) -> None:
    c = Catalog(tmp_path, max_checkpoints=100, max_runs=100, max_bytes=25)
    for tenant in ("t-a", "t-b"):
        c.add_run(tenant, f"run-{tenant}", "sess", f"sess:{tenant}", "tiny", 4, None)
    put(c, "t-a", TRAINING, "s1", 10)
    put(c, "t-a", SAMPLER, "p1", 10)
    before = files_under(tmp_path)
    with pytest.raises(TinkerError, match=r"tinker\.max_checkpoint_bytes_per_tenant \(25\)") as info:
        put(c, "t-a", TRAINING, "s2", 10)
    assert info.value.key == "path" and "nothing was saved" in info.value.message
    assert files_under(tmp_path) == before  # no partial files, no record
    assert c.usage("t-a") == {"checkpoints": 2, "max_checkpoints": 100, "bytes": 20, "max_bytes": 25}
    assert put(c, "t-a", TRAINING, "s1", 15) == 15  # replacing one counts its old bytes out
    assert c.usage("t-a")["bytes"] == 25
    with pytest.raises(TinkerError, match="max_checkpoint_bytes_per_tenant"):
        c.check_room("t-a", "run-t-a", TRAINING, "s3")  # refused before anything is written
    with pytest.raises(TinkerError, match="max_checkpoint_bytes_per_tenant") as info:
        c.copy("t-a", "run-copy", c.checkpoint("t-a", "run-t-a", SAMPLER, "p1"), ttl_s=None, key=None)
    assert info.value.key == "source_path"
    assert put(c, "t-b", TRAINING, "s1", 25) == 25  # another tenant has its own quota

    floor = Catalog(tmp_path, max_checkpoints=100, max_runs=100, min_free_bytes=NO_ROOM)
    before = files_under(tmp_path)
    with pytest.raises(TinkerError, match="tinker.min_free_disk_bytes"):
        put(floor, "t-b", TRAINING, "s2", 1)
    assert files_under(tmp_path) == before


def test_a_real_save_state_over_the_quota_fails_clearly_and_leaves_nothing(
    backend: TinkerBackend, tmp_path: Path
) -> None:
    queue = BatchingQueue(backend, window_s=0.0)
    settings = TinkerConfig(max_checkpoint_bytes_per_tenant=1000)  # less than one saved state
    state = ServerState(backend, queue, base_model="tiny", state_dir=tmp_path / "states", settings=settings)
    try:
        session = state.registry.open_session("t-a")
        state.create_model("t-a", session.session_id, f"{session.session_id}:train:0", 4, 0, None)
        owned = state.registry.model("t-a", f"{session.session_id}:train:0")
        before = files_under(tmp_path / "states")
        with pytest.raises(TinkerError, match="tinker.max_checkpoint_bytes_per_tenant"):
            state.save_weights("t-a", owned, "s1", overwrite=False)
        with pytest.raises(TinkerError, match="tinker.max_checkpoint_bytes_per_tenant"):
            state.save_for_sampler("t-a", owned, f"tinker://{owned.run_id}/sampler_weights/p1", None)
        assert files_under(tmp_path / "states") == before and state.catalog.checkpoints("t-a") == []
    finally:
        queue.close()


def test_a_tenants_list_and_save_never_wait_for_another_tenants_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t-a's run file write hangs (a slow disk, a flood of saves): t-b lists, saves and counts meanwhile."""
    c = Catalog(tmp_path, max_checkpoints=100, max_runs=100)
    c.add_run("t-b", "run-t-b", "sess-b", "sess-b:train:0", "tiny", 4, None)
    gate, writing = threading.Event(), threading.Event()
    write = catalog_module.write_json_atomic

    def slow_for_t_a(path: Path, data: dict) -> None:
        if data["tenant"] == "t-a":
            writing.set()
            gate.wait(30)
        write(path, data)

    monkeypatch.setattr(catalog_module, "write_json_atomic", slow_for_t_a)
    stuck = threading.Thread(
        target=c.add_run, args=("t-a", "run-a", "sess-a", "sess-a:train:0", "tiny", 4, None)
    )
    stuck.start()
    try:
        assert writing.wait(10)
        served: list[object] = []

        def t_b() -> None:
            served.append([r.run_id for r in c.runs("t-b")])
            put(c, "t-b", TRAINING, "s1", 5)
            served.append(c.usage("t-b")["bytes"])

        other = threading.Thread(target=t_b)
        other.start()
        other.join(10)
        assert served == [["run-t-b"], 5]
    finally:
        gate.set()
        stuck.join(30)
    assert [r.run_id for r in c.runs("t-a")] == ["run-a"]
