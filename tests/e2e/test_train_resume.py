"""A training run SIGKILLed mid-way and resumed ends with exactly the weights, optimizer state and
data offsets of an uninterrupted run (resume from the last complete checkpoint), with one trainer
rank and with two data-parallel ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from miles_multilora.rl import checkpoint as ckpt
from tests.e2e.conftest import (
    REPO_ROOT,
    adapter_checkpoints,
    checkpoint_tensors,
    final_checkpoint,
    max_abs_diff,
    optimizer_tensors,
    tiny_run_config,
    toy_adapter,
)

STEPS = 6
SAVE_INTERVAL = 2
KILL_AFTER_STEP = 2  # wait until this global step is logged (its checkpoints reported), then kill
ADAPTERS = [
    toy_adapter("lower", "fraction_of_lowercase", steps=STEPS, save_interval=SAVE_INTERVAL),
    toy_adapter("digits", "fraction_of_digits", steps=STEPS, batched=True, save_interval=SAVE_INTERVAL),
]

TRAIN_SCRIPT = """
import json, sys
from tests.e2e.conftest import tiny_run_config
from miles_multilora.launch.run import run_training
run_training(tiny_run_config(sys.argv[1], json.loads(sys.argv[2]), model={"source": "tiny", "dp": int(sys.argv[3])}))
"""


def _logged_steps(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _start_and_kill(out: Path, dp: int, timeout_s: float = 240.0) -> int:
    """Train in a subprocess (own process group, own Ray) and SIGKILL the whole group once
    ``KILL_AFTER_STEP`` steps are logged. Returns the number of global steps logged by then."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN_SCRIPT, str(out), json.dumps(ADAPTERS), str(dp)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(
                    f"training exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}"
                )
            logged = {r["global_step"] for r in _logged_steps(out)}
            if len(logged) >= KILL_AFTER_STEP:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"no {KILL_AFTER_STEP} steps logged within {timeout_s}s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray processes and trainer actor
        proc.wait()
        proc.stderr.close()
    return len({r["global_step"] for r in _logged_steps(out)})


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dp1", "dp2"])
def test_killed_and_resumed_run_matches_uninterrupted_run(tmp_path: Path, ray_session: None, dp: int) -> None:
    from miles_multilora.launch.run import run_training

    model = {"source": "tiny", "dp": dp}
    killed = tmp_path / "killed"
    steps_before_kill = _start_and_kill(killed, dp)
    assert steps_before_kill < STEPS, "the run finished before it could be killed"
    resume_points = {a["name"]: adapter_checkpoints(killed, a["name"]) for a in ADAPTERS}
    assert all(resume_points.values()), f"no complete checkpoint before the kill: {resume_points}"

    records = run_training(tiny_run_config(killed, ADAPTERS, trainer={"resume": True}, model=model))
    assert {n: (r["state"], r["step"]) for n, r in records.items()} == {
        "lower": ("DONE", STEPS),
        "digits": ("DONE", STEPS),
    }
    # The resumed run restarted after a checkpoint (not from scratch) and redid only later steps.
    rows = _logged_steps(killed)
    for name in ("lower", "digits"):
        steps = [r["step"] for r in rows if r["adapter"] == name]
        resumed = steps[steps_before_kill:]  # rows the resumed run appended
        assert resumed and resumed[0] > 1 and (resumed[0] - 1) % SAVE_INTERVAL == 0, steps
        assert resumed == list(range(resumed[0], STEPS + 1)), steps

    straight = tmp_path / "straight"
    run_training(tiny_run_config(straight, ADAPTERS, model=model))

    for name in ("lower", "digits"):
        a, b = final_checkpoint(killed, name), final_checkpoint(straight, name)
        assert a.name == b.name == f"step_{STEPS:06d}"
        assert sorted(p.name for p in a.glob("slot_rank*.pt")) == ["slot_rank0.pt"]  # one shard per TP rank
        assert max_abs_diff(checkpoint_tensors(a), checkpoint_tensors(b)) <= 1e-6, name
        assert max_abs_diff(optimizer_tensors(a), optimizer_tensors(b)) <= 1e-6, name
        assert ckpt.read_state(a)["data"] == ckpt.read_state(b)["data"], name
        assert ckpt.read_state(b)["metrics"]["step"] == STEPS  # the step's row, should the report be lost
