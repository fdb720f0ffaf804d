"""The catalog of training runs and checkpoints on its own: what a new catalog over the same
directory reads back (a server restart), tenant isolation, expiry, and the per-tenant caps. Time
is a clock the test advances."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_multilora.tinker.catalog import EXTERNAL, SAMPLER, TRAINING, Catalog
from miles_multilora.tinker.registry import Unknown
from miles_multilora.tinker.requests import TinkerError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def catalog(root: Path, clock: Clock, **caps: int) -> Catalog:
    return Catalog(root, max_checkpoints=caps.get("max_checkpoints", 100), max_runs=caps.get("max_runs", 100),
                   clock=clock)  # fmt: skip


def saved(c: Catalog, tenant: str, run: str, kind: str, name: str, ttl_s: int | None = None) -> None:
    """A checkpoint with files, as the server writes them."""
    files = c.files_of(tenant, run, kind, name)
    files.mkdir(parents=True)
    (files / "f").write_bytes(b"x" * 10)
    c.check_room(tenant, run, kind, name)
    c.add_checkpoint(tenant, run, kind, name, size_bytes=10, ttl_s=ttl_s, user_metadata={"k": "v"})


def test_runs_and_checkpoints_of_every_kind_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    c = catalog(tmp_path, clock)
    c.add_run("t-a", "run-1", "sess-1", "sess-1:train:0", "tiny", 4, {"exp": "1"})
    saved(c, "t-a", "run-1", TRAINING, "s1", ttl_s=50)
    saved(c, "t-a", "run-1", EXTERNAL, "e1")
    saved(c, "t-a", "run-1", SAMPLER, "p1")
    c.set_public("t-a", "run-1", TRAINING, "s1", True)

    again = catalog(tmp_path, clock)
    run = again.run("t-a", "run-1")
    assert (run.base_model, run.lora_rank, run.user_metadata) == ("tiny", 4, {"exp": "1"})
    assert again.run("t-a", "sess-1:train:0").run_id == "run-1"  # by its model's id too
    assert sorted(run.checkpoints) == ["external_weights/e1", "sampler_weights/p1", "weights/s1"]
    s1 = run.checkpoints["weights/s1"]
    assert (s1.public, s1.expires_at, s1.user_metadata, s1.size_bytes) == (True, 1050.0, {"k": "v"}, 10)


def test_a_checkpoint_whose_files_are_gone_is_dropped_at_start(tmp_path: Path) -> None:
    clock = Clock()
    c = catalog(tmp_path, clock)
    c.add_run("t-a", "run-1", "sess-1", "sess-1:train:0", "tiny", 4, None)
    saved(c, "t-a", "run-1", TRAINING, "s1")
    c.files_of("t-a", "run-1", TRAINING, "s1").joinpath("f").unlink()
    c.files_of("t-a", "run-1", TRAINING, "s1").rmdir()
    (tmp_path / "t-a" / "runs" / "junk.json").write_text("{not json")
    assert catalog(tmp_path, clock).run("t-a", "run-1").checkpoints == {}


def test_another_tenant_sees_nothing_and_a_published_checkpoint_only_by_path(tmp_path: Path) -> None:
    c = catalog(tmp_path, Clock())
    c.add_run("t-a", "run-1", "sess-1", "sess-1:train:0", "tiny", 4, None)
    saved(c, "t-a", "run-1", TRAINING, "s1")
    for attempt in (
        lambda: c.run("t-b", "run-1"),
        lambda: c.run("t-b", "sess-1:train:0"),
        lambda: c.checkpoint("t-b", "run-1", TRAINING, "s1"),
        lambda: c.remove("t-b", "run-1", TRAINING, "s1"),
        lambda: c.set_public("t-b", "run-1", TRAINING, "s1", True),
        lambda: c.set_ttl("t-b", "run-1", TRAINING, "s1", 5),
    ):
        with pytest.raises(Unknown, match="unknown training run 'run-1'|unknown training run 'sess"):
            attempt()
    assert c.runs("t-b") == [] and c.checkpoints("t-b") == []
    assert c.published("run-1", TRAINING, "s1") is None
    c.set_public("t-a", "run-1", TRAINING, "s1", True)
    assert c.published("run-1", TRAINING, "s1") is not None
    assert c.files_of("t-a", "run-1", TRAINING, "s1").is_dir()


def test_expiry_removal_and_the_checkpoint_cap(tmp_path: Path) -> None:
    clock = Clock()
    c = catalog(tmp_path, clock, max_checkpoints=2)
    c.add_run("t-a", "run-1", "sess-1", "sess-1:train:0", "tiny", 4, None)
    saved(c, "t-a", "run-1", TRAINING, "short", ttl_s=5)
    saved(c, "t-a", "run-1", TRAINING, "long")
    with pytest.raises(TinkerError, match="tinker.max_checkpoints"):
        c.check_room("t-a", "run-1", TRAINING, "third")
    c.check_room("t-a", "run-1", TRAINING, "long")  # replacing one is fine
    assert c.expired() == []
    clock.now += 5
    assert [r.name for _, r in c.expired()] == ["short"]
    c.remove("t-a", "run-1", TRAINING, "short")
    assert not c.files_of("t-a", "run-1", TRAINING, "short").exists()
    assert sorted(p.name for p in (tmp_path / "t-a").iterdir()) == ["runs", "weights"]  # nothing left aside
    with pytest.raises(Unknown, match="no checkpoint"):
        c.remove("t-a", "run-1", TRAINING, "short")
    c.check_room("t-a", "run-1", TRAINING, "third")  # room again


def test_past_max_runs_the_oldest_runs_without_checkpoints_or_models_are_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    live = {"run-0"}
    c = Catalog(tmp_path, max_checkpoints=10, max_runs=2, live_runs=lambda: live, clock=clock)
    for i in range(4):
        clock.now += 1
        c.add_run("t-a", f"run-{i}", "sess-1", f"sess-1:train:{i}", "tiny", 4, None)
        if i == 1:
            saved(c, "t-a", "run-1", TRAINING, "keep")
    c.add_run("t-b", "run-b", "sess-2", "sess-2:train:0", "tiny", 4, None)  # another tenant's count
    # run-0 is live and run-1 has a checkpoint: run-2 (oldest of the rest) went when run-3 came
    assert [r.run_id for r in c.runs("t-a")] == ["run-3", "run-1", "run-0"]
    assert not (tmp_path / "t-a" / "runs" / "run-2.json").exists()
    assert [r.run_id for r in c.runs("t-b")] == ["run-b"]


def test_a_copy_is_a_new_run_that_outlives_its_source_and_a_restart(tmp_path: Path) -> None:
    """``copy``: a new run of the copying tenant, its files linked (the same bytes, not the same
    directory), kept when the source goes, found again by its idempotency key after a restart."""
    clock = Clock()
    c = catalog(tmp_path, clock, max_checkpoints=2)
    c.add_run("t-a", "run-1", "sess-1", "sess-1:train:0", "tiny", 4, None, ("attn",))
    saved(c, "t-a", "run-1", SAMPLER, "p1", ttl_s=50)
    clock.now += 5
    run, record = c.copy("t-b", "run-2", c.checkpoint("t-a", "run-1", SAMPLER, "p1"), ttl_s=None, key="k1")
    assert (run.tenant, run.lora_rank, run.lora_targets, run.copied_from) == (
        "t-b",
        4,
        ["attn"],
        "tinker://run-1/sampler_weights/p1",
    )
    assert (record.kind, record.name, record.created, record.expires_at) == (SAMPLER, "p1", 1005.0, None)
    assert record.user_metadata is None  # another tenant's metadata is not copied
    copied = c.files_of("t-b", "run-2", SAMPLER, "p1") / "f"
    assert copied.read_bytes() == b"x" * 10
    with pytest.raises(Unknown):
        c.run("t-a", "run-2")  # the copy is t-b's alone
    again = c.copy("t-b", "run-3", c.checkpoint("t-a", "run-1", SAMPLER, "p1"), ttl_s=None, key="k1")
    assert again[0].run_id == "run-2" and len(c.checkpoints("t-b")) == 1  # a retry: no second copy

    c.remove("t-a", "run-1", SAMPLER, "p1")
    restarted = catalog(tmp_path, clock, max_checkpoints=2)
    assert copied.read_bytes() == b"x" * 10
    assert restarted.checkpoint("t-b", "run-2", SAMPLER, "p1")[1].name == "p1"
    source = restarted.checkpoint("t-b", "run-2", SAMPLER, "p1")
    assert restarted.copy("t-b", "run-4", source, ttl_s=None, key="k1")[0].run_id == "run-2"
    gone = (restarted.run("t-a", "run-1"), record)  # its files were deleted: nothing to copy
    with pytest.raises(FileNotFoundError):
        restarted.copy("t-b", "run-6", gone, ttl_s=None, key=None)
    clock.now += 1
    restarted.copy("t-b", "run-4", source, ttl_s=100, key="k2")
    with pytest.raises(TinkerError, match="tinker.max_checkpoints"):
        restarted.copy("t-b", "run-5", source, ttl_s=None, key="k3")
    assert not restarted.files_of("t-b", "run-5", SAMPLER, "p1").exists()
    assert not restarted.files_of("t-b", "run-6", SAMPLER, "p1").exists()
    assert [r.run_id for r in restarted.runs("t-b")] == ["run-4", "run-2"]
