"""What the RL door's checkpoints may take on disk: bytes per tenant, and a floor of free disk.

A tenant (an adapter spec's ``tenant``, default the adapter's own name) holds the complete
checkpoints of all its adapters' runs under ``<output_dir>/checkpoints/`` (each run keeps its last
``trainer.keep_checkpoints``; runs that ended keep theirs until someone deletes them). A save that
would bring the tenant past ``trainer.max_checkpoint_bytes_per_tenant``, or that finds the disk
below ``trainer.min_free_disk_bytes`` free, is refused and leaves nothing behind: the adapter fails
with the reason (the others go on).

The writer rank learns the tenants' bytes once, by walking the checkpoint tree on its first save
(one ``state.json`` read per run directory), and keeps them up to date with its own saves; a run
directory deleted by hand stops counting at once, one copied in by hand counts after a restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from miles_multilora.disk_usage import dir_size, low_disk
from miles_multilora.rl.checkpoint_layout import complete_checkpoints

BYTES_SETTING = "trainer.max_checkpoint_bytes_per_tenant"
FLOOR_SETTING = "trainer.min_free_disk_bytes"


@dataclass(frozen=True)
class DiskLimits:
    """``max_bytes_per_tenant``: a tenant's complete checkpoints, all its runs (0: no limit);
    ``min_free_bytes``: the free disk below which a save is refused (0: none)."""

    max_bytes_per_tenant: int = 0
    min_free_bytes: int = 0


class QuotaExceeded(Exception):
    """A save refused by :class:`DiskLimits` (the message says which and what to do)."""


class CheckpointUsage:
    """Bytes of complete checkpoints per run directory, with each run's tenant."""

    def __init__(self, root: Path) -> None:
        self.root = root  # <output_dir>/checkpoints
        self._runs: dict[Path, tuple[str, int]] | None = None

    def _index(self) -> dict[Path, tuple[str, int]]:
        if self._runs is None:
            self._runs = {}
            adapters = sorted(self.root.iterdir()) if self.root.is_dir() else []
            for run in (r for a in adapters if a.is_dir() for r in sorted(a.iterdir()) if r.is_dir()):
                kept = complete_checkpoints(run)
                if kept:
                    self._runs[run] = (_tenant_of(kept[-1]), sum(dir_size(p) for p in kept))
        for run in [r for r in self._runs if not r.is_dir()]:  # deleted by hand
            del self._runs[run]
        return self._runs

    def tenant_bytes(self, tenant: str, without: Path | None = None) -> int:
        """Bytes of ``tenant``'s complete checkpoints, leaving out run directory ``without``."""
        return sum(n for run, (t, n) in self._index().items() if t == tenant and run != without)

    def update(self, run: Path, tenant: str) -> int:
        """Measure ``run`` again (after a save and its retention); returns the tenant's bytes."""
        runs = self._index()
        runs[run] = (tenant, sum(dir_size(p) for p in complete_checkpoints(run)))
        return self.tenant_bytes(tenant)

    def admit(self, stage: Path, run: Path, tenant: str, keep: int, limits: DiskLimits) -> None:
        """Raise :class:`QuotaExceeded` when renaming ``stage`` into ``run`` (keeping its newest
        ``keep``) would bring ``tenant`` past ``limits``, or the disk is below their floor."""
        check_free_disk(stage, limits)
        limit = limits.max_bytes_per_tenant
        if limit <= 0:
            return
        new = dir_size(stage)
        final_name = stage.name.removeprefix(".tmp-")
        older = (
            [p for p in complete_checkpoints(run) if p.name != final_name][-(keep - 1) :] if keep > 1 else []
        )
        total = self.tenant_bytes(tenant, without=run) + sum(dir_size(p) for p in older) + new
        if total > limit:
            raise QuotaExceeded(
                f"this checkpoint ({new} bytes) would bring tenant {tenant!r}'s checkpoints to {total} "
                f"bytes, over {BYTES_SETTING} ({limit}); nothing was saved. Delete the run directories "
                f"of its finished adapters under {self.root}, keep fewer (trainer.keep_checkpoints), "
                "or ask the operator for a larger quota"
            )


def check_free_disk(path: str | Path, limits: DiskLimits) -> None:
    """Raise :class:`QuotaExceeded` when the disk of ``path`` is below the floor of ``limits``."""
    why = low_disk(path, limits.min_free_bytes, FLOOR_SETTING)
    if why is not None:
        raise QuotaExceeded(why)


_USAGE: dict[Path, CheckpointUsage] = {}


def usage_of(output_dir: str | Path) -> CheckpointUsage:
    """This process's view of the checkpoints under ``<output_dir>/checkpoints`` (one per root)."""
    root = (Path(output_dir) / "checkpoints").resolve()
    if root not in _USAGE:
        _USAGE[root] = CheckpointUsage(root)
    return _USAGE[root]


def _tenant_of(checkpoint: Path) -> str:
    """Whose a checkpoint is, from its ``state.json`` (its spec's tenant, else its adapter)."""
    try:
        state = json.loads((checkpoint / "state.json").read_text())
        spec = state.get("spec") or {}
        return str(spec.get("tenant") or state.get("adapter") or checkpoint.parent.parent.name)
    except (OSError, ValueError, AttributeError):
        return checkpoint.parent.parent.name  # the adapter's name: its own tenant
