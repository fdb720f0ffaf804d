"""Checkpoints keyed by run, retention inside the run only, and resuming with a fallback to the
newest readable checkpoint when the controller's resume point is missing or unreadable."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.controller.snapshot import SlotAssignment
from miles_multilora.data import MultiLoRADataSource
from miles_multilora.errors import SpecError
from miles_multilora.launch.loop import recover_lost_metrics
from miles_multilora.launch.metrics import MetricsLogger, read_metrics
from miles_multilora.rl import checkpoint as ckpt
from miles_multilora.rl import checkpoint_layout as layout
from miles_multilora.rl.resume import ResumeError, check_run_dir_is_ours, load_resume_point
from miles_multilora.trainer.shard import read_shard

SPEC = parse_adapter_spec({"name": "a", "dataset": {"task": "basic_arithmetic"}, "num_steps": 9})


def _write(out: Path, run_id: str, step: int, world_size: int = 1, keep: int = 5, spec=SPEC) -> Path:
    stage = layout.staging_dir(layout.run_dir(out, spec.name, run_id), step)
    stage.mkdir(parents=True)
    for rank in range(world_size):
        torch.save(
            {"slot": {"w": torch.full((2,), float(step))}, "optimizer": {"step": step}},
            stage / f"slot_rank{rank}.pt",
        )
    state = {"adapter": spec.name, "run_id": run_id, "step": step, "spec": spec.to_dict(), "data": {}}
    return ckpt.finalize(stage, state, keep=keep)


def _assignment(run_id: str, resume: Path | None) -> SlotAssignment:
    return SlotAssignment("a", run_id, 0, SPEC, 0, None if resume is None else str(resume), True)


def test_runs_of_one_name_keep_separate_directories_and_retention_stays_inside_a_run(tmp_path):
    first = [_write(tmp_path, "a-1", step, keep=2) for step in (1, 2, 3)]
    second = [_write(tmp_path, "a-7", step, keep=2) for step in (1, 2, 3)]
    assert [p.name for p in layout.complete_checkpoints(first[-1].parent)] == ["step_000002", "step_000003"]
    assert [p.name for p in layout.complete_checkpoints(second[-1].parent)] == ["step_000002", "step_000003"]
    assert layout.latest_run_dir(tmp_path, "a") == second[-1].parent
    shard = read_shard(first[-1], 0)  # weights_only=True: plain tensors and values
    assert shard["optimizer"]["step"] == 3 and torch.equal(shard["slot"]["w"], torch.full((2,), 3.0))


def test_resume_uses_the_named_checkpoint_or_falls_back_to_the_newest_readable_one(tmp_path):
    paths = [_write(tmp_path, "a-1", step, world_size=2) for step in (2, 4, 6)]
    path, state, shard = load_resume_point(_assignment("a-1", paths[1]), rank=1, world_size=2)
    assert (path, state["step"], shard["optimizer"]["step"]) == (paths[1], 4, 4)
    (paths[2] / "slot_rank1.pt").write_bytes(b"torn")  # unreadable for rank 1 only: every rank skips it
    path, state, _ = load_resume_point(_assignment("a-1", paths[2]), rank=0, world_size=2)
    assert (path, state["step"]) == (paths[1], 4)
    missing = paths[2].parent / "step_000008"
    path, _, _ = load_resume_point(_assignment("a-1", missing), rank=0, world_size=2)
    assert path == paths[1]
    for p in paths[:2]:
        (p / "state.json").write_text("{broken")
    with pytest.raises(ResumeError, match="no readable checkpoint"):
        load_resume_point(_assignment("a-1", paths[2]), rank=0, world_size=2)


def test_a_checkpoint_saved_at_another_tp_size_resumes(tmp_path):
    """Saved at TP=1, resumed at TP=2 and the reverse: readable when every shard it was saved with
    is (each rank then reads it re-split), with no shard of the resuming rank's own."""
    one, two = _write(tmp_path, "a-1", 2, world_size=1), _write(tmp_path, "a-1", 4, world_size=2)
    assert load_resume_point(_assignment("a-1", one), rank=1, world_size=2) == (
        one,
        ckpt.read_state(one),
        None,
    )
    path, state, shard = load_resume_point(_assignment("a-1", two), rank=0, world_size=1)
    assert (path, state["step"], shard) == (two, 4, None)
    (two / "slot_rank1.pt").write_bytes(b"torn")  # a torn shard of its own TP size: skipped, as ever
    assert load_resume_point(_assignment("a-1", two), rank=0, world_size=1)[0] == one


def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(tmp_path):
    other = parse_adapter_spec({"name": "a", "dataset": {"task": "basic_arithmetic"}, "num_steps": 3})
    run = _write(tmp_path, "a-1", 1, spec=other).parent  # same run id, other spec: a reset controller
    with pytest.raises(ResumeError, match="another run"):
        check_run_dir_is_ours(run, _assignment("a-1", None))
    check_run_dir_is_ours(tmp_path / "empty", _assignment("a-1", None))
    mine = _write(tmp_path, "a-2", 1).parent  # its own checkpoint, written before a crash
    check_run_dir_is_ours(mine, _assignment("a-2", None))


def test_an_adapter_whose_data_fails_is_left_out_with_its_cursor_unmoved(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q0", "answer": "0"}\n{"question": null, "answer": "1"}\n')
    source = MultiLoRADataSource()
    good = parse_adapter_spec(
        {"name": "good", "dataset": {"task": "basic_arithmetic"}, "num_steps": 3, "prompts_per_step": 2}
    )
    bad = parse_adapter_spec(
        {"name": "bad", "dataset": {"path": str(data), "shuffle": False}, "num_steps": 3,
         "prompts_per_step": 2, "prompt": {"template": "{question}", "use_chat_template": False}}
    )  # fmt: skip
    source.add_adapter(good)
    source.add_adapter(bad)
    errors: dict[str, Exception] = {}
    batch = source.next_batch(errors=errors)
    assert list(batch) == ["good"] and len(batch["good"]) == 2
    assert list(errors) == ["bad"] and isinstance(errors["bad"], SpecError)
    assert "dataset row 1" in str(errors["bad"]) and "'question' is null" in str(errors["bad"])
    assert source.adapter_state("bad")["offset"] == 0 and source.adapter_state("bad")["drawn"] == 0
    with pytest.raises(SpecError, match="null"):
        source.next_batch(names=["bad"])


def _with_metrics(saved: Path, metrics: dict) -> None:
    (saved / "state.json").write_text(json.dumps(ckpt.read_state(saved) | {"metrics": metrics}))


def test_a_step_checkpointed_but_never_reported_gets_its_metrics_row_from_the_checkpoint(tmp_path):
    """The ranks died after saving step 6 but before reporting it: the adapter resumes past it, so
    the driver logs step 6's row from the checkpoint (once), and nothing for a step already logged."""
    logger = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False, plot=False), tmp_path)
    logger.log_step(0, {"a": {"step": 5, "reward": 0.1}, "b": {"step": 4, "reward": 0.2}}, {})
    _with_metrics(_write(tmp_path, "a-1", 6), {"step": 6, "reward": 0.7})
    b_spec = parse_adapter_spec({"name": "b", "dataset": {"task": "basic_arithmetic"}, "num_steps": 9})
    _with_metrics(_write(tmp_path, "b-2", 4, spec=b_spec), {"step": 4, "reward": 0.2})
    b = SlotAssignment("b", "b-2", 1, b_spec, 4, None, False)
    snapshot = SimpleNamespace(adapters=[_assignment("a-1", None), b])
    assert recover_lost_metrics(logger, snapshot, global_step=1) == 1
    rows = read_metrics(logger.jsonl_path)
    assert [(r["adapter"], r["step"], r["global_step"]) for r in rows][-1] == ("a", 6, 1)
    assert rows[-1]["recovered"] == 1 and rows[-1]["reward"] == 0.7
    assert recover_lost_metrics(logger, snapshot, global_step=2) == 0  # logged once
