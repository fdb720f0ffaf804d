"""The catalog of training runs and checkpoints on its own: what a new catalog over the same
directory reads back (a server restart), tenant isolation, expiry, and the per-tenant caps. Time
is a clock the test advances."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_multilora.tinker.backend import TinkerError
from miles_multilora.tinker.catalog import EXTERNAL, SAMPLER, TRAINING, Catalog
from miles_multilora.tinker.registry import Unknown


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
