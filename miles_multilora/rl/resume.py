"""Resuming an adapter from its checkpoint, falling back to the newest readable one of its run.

The controller names a resume checkpoint; after a crash it may be missing or unreadable (deleted,
truncated). Then the run's other complete checkpoints are tried, newest first; an adapter with
none readable fails alone, and the service still comes up. A candidate counts as readable only
when its state and *every* TP rank's shard load, so every rank picks the same one without talking.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_multilora.controller.snapshot import SlotAssignment
from miles_multilora.rl import checkpoint as ckpt
from miles_multilora.rl import checkpoint_layout as layout
from miles_multilora.trainer.shard import read_shard
from miles_multilora.trainer.tp_reshard import saved_tp_size


class ResumeError(RuntimeError):
    """No checkpoint of the run could be loaded."""


def _readable(path: Path, run_id: str, world_size: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The checkpoint's state and every TP shard it was saved with (``world_size`` of them when it
    has none: the read names the missing file); a state saved at another TP size loads re-split."""
    state = ckpt.read_state(path)
    if state.get("run_id") not in (None, run_id):
        raise ResumeError(f"{path} belongs to run {state.get('run_id')!r}, not {run_id!r}")
    shards = [read_shard(path, r) for r in range(saved_tp_size(path) or world_size)]
    return state, shards


def load_resume_point(
    assignment: SlotAssignment, rank: int, world_size: int
) -> tuple[Path, dict[str, Any], dict[str, Any] | None]:
    """The checkpoint to resume ``assignment`` from: ``(path, state, shard)``, the shard of TP rank
    ``rank`` of ``world_size`` (None when the checkpoint was saved at another TP size: the rank
    reads it re-split, :meth:`~miles_multilora.trainer.rank.TrainerRank.read_shard`).

    Tries ``assignment.resume_checkpoint`` first, then the complete checkpoints of its run
    directory, newest first. Raises :class:`ResumeError` listing why each one failed.
    """
    assert assignment.resume_checkpoint is not None
    wanted = Path(assignment.resume_checkpoint)
    others = [p for p in reversed(layout.complete_checkpoints(wanted.parent)) if p != wanted]
    errors = []
    for path in [wanted, *others]:
        try:
            state, shards = _readable(path, assignment.run_id, world_size)
        except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is skipped
            errors.append(f"{path.name}: {type(exc).__name__}: {exc}")
            continue
        return path, state, shards[rank] if len(shards) == world_size else None
    raise ResumeError(
        f"no readable checkpoint to resume {assignment.name!r} from ({'; '.join(errors) or 'none found'})"
    )


def check_run_dir_is_ours(run: Path, assignment: SlotAssignment) -> None:
    """A fresh run must not write into checkpoints of another run that got the same id (a reset
    controller state over an old output dir): refuse rather than prune them. Checkpoints of this
    very run (same id and spec: a crash hit before the controller recorded them) are fine."""
    spec = assignment.spec.to_dict()
    for path in layout.complete_checkpoints(run):
        try:
            state = ckpt.read_state(path)
            owner = state.get("run_id")
        except Exception:  # noqa: BLE001 - unreadable leftovers are someone's data too
            state, owner = {}, "<unreadable>"
        if owner == assignment.run_id and state.get("spec") == spec:
            continue
        raise ResumeError(
            f"{run} already holds checkpoints of another run {owner!r} (found {path.name}) although run "
            f"{assignment.run_id!r} starts fresh; was the controller state reset? Move that directory "
            "away or use another trainer.output_dir"
        )
