"""Per-adapter checkpoints of the RL recipe, written atomically, one directory per run.

Layout: ``<output_dir>/checkpoints/<adapter>/<run_id>/step_000012/`` holding

- ``adapter/``                     PEFT adapter (adapter_model.safetensors + adapter_config.json)
- ``slot_rank{r}.pt``              this TP rank's exact slot tensors (A/B shards) + optimizer state
                                   (:mod:`miles_multilora.trainer.shard`)
- ``state.json``                   step, version, spec, data-source offsets, RNG seed
- ``COMPLETE``                     written last: a dir without it is never read

Every file is written into ``.tmp-step_000012`` first; rank 0 renames it into place after all ranks
wrote their shard, so a crash at any point leaves either the previous complete checkpoint or this one.
A run's directory is its own (keyed by the controller's run id, unique per registration), so a
re-registered name never shares, prunes or resumes another run's checkpoints; retention only
deletes inside it. Shards load with ``torch.load(weights_only=True)``: tensors and plain values only.
Every directory is ``0700`` and every file ``0600`` (:mod:`miles_multilora.private_files`). A save
past its tenant's byte quota or below the free-disk floor is refused and its staging directory
removed (:mod:`~miles_multilora.rl.checkpoint_quota`). The layout's names are :mod:`~miles_multilora.rl.checkpoint_layout`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_multilora.controller.quotas import tenant_of
from miles_multilora.controller.snapshot import SlotAssignment
from miles_multilora.private_files import make_private, private_dir, private_open
from miles_multilora.rl.checkpoint_layout import (
    COMPLETE_MARKER,
    is_complete,
    run_dir,
    staging_dir,
    step_name,
)
from miles_multilora.rl.checkpoint_quota import DiskLimits, QuotaExceeded, check_free_disk, usage_of
from miles_multilora.rl.faults import failure_reason, first_error

if TYPE_CHECKING:  # a type only: checkpoints stay light (no Megatron)
    from miles_multilora.trainer.rank import RankPrimitives


def finalize(stage: Path, state: dict[str, Any], keep: int) -> Path:
    """Write state.json and the marker, rename the staging dir into place (owner-only, whatever
    wrote into it), apply retention."""
    for name, text in (("state.json", json.dumps(state, indent=1, default=str)), (COMPLETE_MARKER, "ok\n")):
        with private_open(stage / name, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    make_private(stage)
    final = stage.parent / stage.name.removeprefix(".tmp-")
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    existing = sorted(p for p in stage.parent.iterdir() if p.name.startswith("step_") and is_complete(p))
    for old in existing[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return json.loads((path / "state.json").read_text())


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (on some rank); the adapter fails, the service goes on."""


class SavedCheckpoint(str):
    """A complete checkpoint's path, with its tenant's checkpoint bytes after the save
    (``tenant_bytes``, what the step's metrics show as ``checkpoint/tenant_bytes``)."""

    tenant_bytes: int

    def __new__(cls, path: str, tenant_bytes: int) -> SavedCheckpoint:
        saved = super().__new__(cls, path)
        saved.tenant_bytes = tenant_bytes
        return saved

    def __reduce__(self) -> tuple[Any, ...]:
        return SavedCheckpoint, (str(self), self.tenant_bytes)


def write_checkpoint(
    rank: RankPrimitives,
    output_dir: str | Path,
    assignment: SlotAssignment,
    data: dict[str, Any],
    keep: int,
    limits: DiskLimits = DiskLimits(),
    metrics: dict[str, Any] | None = None,
) -> SavedCheckpoint:
    """Checkpoint ``assignment``'s slot at its current version (a collective: every rank calls it):
    the rank's slot shards and PEFT export, then ``state.json`` with ``data`` (its data-source
    offsets) and the step's ``metrics`` (its metrics row, logged again by the driver if the ranks die
    before reporting the step: :func:`~miles_multilora.launch.loop.recover_lost_metrics`) and the
    marker. A failure on any rank, or a save past ``limits`` (checked by the
    writer once every shard is written), raises :class:`CheckpointError` on every rank; the
    staging directory is removed and nothing half written is ever read."""
    step = rank.version(assignment.slot)
    run = run_dir(output_dir, assignment.name, assignment.run_id)
    stage = staging_dir(run, step)
    error = None
    try:
        check_free_disk(output_dir, limits)  # before writing anything (again once it is written)
        private_dir(stage)
        rank.save_slot(assignment.slot, stage)  # one shard per TP rank, written by DP rank 0
        rank.export_peft(assignment.slot, stage / "adapter")
    except QuotaExceeded as exc:
        error = f"checkpoint step {step} refused: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = failure_reason(f"writing checkpoint step {step} on rank {rank.global_rank}", exc)
    error = first_error(rank.gather(error))
    final, tenant_bytes = stage.parent / step_name(step), 0
    if rank.is_writer:
        if error is None:
            state = {
                "adapter": assignment.name,
                "run_id": assignment.run_id,
                "step": step,
                "version": step,
                "spec": assignment.spec.to_dict(),
                "data": data,
                "time": time.time(),
                **({"metrics": metrics} if metrics is not None else {}),
            }
            tenant, usage = tenant_of(assignment.spec), usage_of(output_dir)
            try:
                usage.admit(stage, run, tenant, keep, limits)
                final = finalize(stage, state, keep=keep)
                tenant_bytes = usage.update(run, tenant)
            except QuotaExceeded as exc:
                error = f"checkpoint step {step} refused: {exc}"
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = failure_reason(f"finalising checkpoint step {step}", exc)
        if error is not None:
            shutil.rmtree(stage, ignore_errors=True)
    error, tenant_bytes = rank.broadcast((error, tenant_bytes))
    if error is not None:
        raise CheckpointError(error)
    return SavedCheckpoint(str(final), tenant_bytes)
