"""Under the usual umask (022) everything both doors write under their state and output directories
is readable by its owner only: 0700 directories, 0600 files. Real writers on one in-process trainer
rank (tiny model, CPU): the RL door's checkpoint (slot shard, PEFT export, state), the controller's
state and run history, the metrics file and reward plot; the Tinker door's saved state, named and
unnamed sampler weights, PEFT export, copy and catalog."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.snapshot import SlotAssignment
from miles_multilora.launch.metrics import MetricsLogger, metrics_path, plot_rewards
from miles_multilora.rl.checkpoint import write_checkpoint
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue
from miles_multilora.tinker.state import ServerState


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def not_private(root: Path) -> dict[str, str]:
    """Everything under ``root`` that another user could read or enter, with its mode."""
    found = {}
    for path in root.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode != (0o700 if path.is_dir() else 0o600):
            found[str(path.relative_to(root))] = oct(mode)
    return found


def test_the_rl_doors_checkpoint_state_history_and_metrics_are_owner_only(
    umask_022: None, backend: TinkerBackend, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    backend.create_model("m", rank=4, seed=1)
    spec = parse_adapter_spec({"name": "a", "dataset": {"task": "basic_arithmetic"}, "num_steps": 9})
    assignment = SlotAssignment("a", "a-1", backend.residency.slots["m"], spec, 0, None, True)
    saved = Path(write_checkpoint(backend.rank, out, assignment, {"offset": 3}, keep=2))
    assert {p.name for p in saved.rglob("*")} >= {"slot_rank0.pt", "adapter_model.safetensors", "state.json"}

    core = ControllerCore(num_slots=1, max_rank=16, state_dir=out / "controller")
    core.register({"name": "b", "dataset": {"task": "basic_arithmetic"}, "num_steps": 5})
    core.cancel("b")  # finished: appended to the run history
    assert {p.name for p in (out / "controller").iterdir()} >= {
        "controller_state.json", "controller_history.jsonl"
    }  # fmt: skip

    log = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False), out)
    log.log_step(1, {"a": {"step": 1, "reward_mean": 0.5}}, {"time_s": 1.0})
    assert plot_rewards(metrics_path(out), out / "rewards.png") is not None
    assert not_private(out) == {}


def test_the_tinker_doors_saves_copies_and_catalog_are_owner_only(
    umask_022: None, backend: TinkerBackend, tmp_path: Path
) -> None:
    queue = BatchingQueue(backend, window_s=0.0)
    state = ServerState(
        backend, queue, base_model="tiny", state_dir=tmp_path / "states", settings=TinkerConfig()
    )
    try:
        session = state.registry.open_session("t-a")
        model_id = f"{session.session_id}:train:0"
        state.create_model("t-a", session.session_id, model_id, 4, 0, None)
        owned = state.registry.model("t-a", model_id)
        state.save_weights("t-a", owned, "s1", overwrite=False)
        state.save_weights("t-a", owned, "s1", overwrite=True)  # replaced in place
        named = f"tinker://{owned.run_id}/sampler_weights/p1"
        state.save_for_sampler("t-a", owned, named, None)
        state.save_for_sampler("t-a", owned, None, f"{session.session_id}:sample:0")
        state.save_external("t-a", owned, "e1", None)
        state.copy_weights("t-a", f"tinker://{owned.run_id}/weights/s1", None, None)
    finally:
        queue.close()
    kinds = {p.name for p in (tmp_path / "states" / "t-a").iterdir()}
    assert kinds >= {"runs", "weights", "sampler_weights", "sampler_sessions", "external_weights"}
    assert not_private(tmp_path / "states") == {}
