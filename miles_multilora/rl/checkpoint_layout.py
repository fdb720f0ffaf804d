"""Where the RL recipe's checkpoints live on disk, and which of them are complete
(:mod:`~miles_multilora.rl.checkpoint` writes them; :mod:`~miles_multilora.rl.checkpoint_quota`
counts them)."""

from __future__ import annotations

from pathlib import Path

COMPLETE_MARKER = "COMPLETE"


def adapter_dir(output_dir: str | Path, adapter: str) -> Path:
    """Where every run of ``adapter`` keeps its run directory."""
    return Path(output_dir) / "checkpoints" / adapter


def run_dir(output_dir: str | Path, adapter: str, run_id: str) -> Path:
    return adapter_dir(output_dir, adapter) / run_id


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def staging_dir(run: Path, step: int) -> Path:
    return run / f".tmp-{step_name(step)}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def complete_checkpoints(run: str | Path) -> list[Path]:
    """Complete checkpoints of one run directory, oldest first (half-written ones are ignored)."""
    root = Path(run)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step_") and is_complete(p))


def _run_seq(path: Path) -> int:
    tail = path.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def latest_run_dir(output_dir: str | Path, adapter: str) -> Path | None:
    """The run directory of ``adapter``'s newest registration (by the run id's sequence number)."""
    root = adapter_dir(output_dir, adapter)
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    return max(runs, key=_run_seq) if runs else None
