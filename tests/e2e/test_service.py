"""Service mode end to end on the tiny model, as a user runs it: ``start_service.sh`` in its own
process group, ``submit_schedule.sh`` driving it over HTTP, a SIGKILL of the whole service mid-run,
a restart on the same output_dir that resumes every unfinished adapter from its checkpoint, and a
graceful SIGTERM. No Ray process may outlive the test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from miles_multilora import third_party_noise
from miles_multilora.controller.client import ControllerClient
from miles_multilora.controller.errors import ControllerUnavailableError
from miles_multilora.controller.persistence import load_state
from miles_multilora.models.compat import free_port
from miles_multilora.rl import checkpoint as ckpt
from miles_multilora.rl import checkpoint_layout as layout
from tests.e2e.conftest import REPO_ROOT, REWARDS, TOY_PROMPTS, adapter_checkpoints, toy_adapter

SCRIPTS = REPO_ROOT / "examples" / "multi_lora"
# a's budget outlasts phase 1 however late the runner cancels b (a loaded machine lets a step on
# meanwhile): the kill must find a RUNNING, whatever the machine's speed
STEPS = {"a": 20, "b": 10, "c": 6}


def _write_specs(spec_dir: Path) -> Path:
    """Adapter specs a/b/c (checkpoint every 2 steps) and the schedule driving them."""
    spec_dir.mkdir()
    for name in STEPS:
        spec = toy_adapter(
            name, "fraction_of_letter_a", steps=STEPS[name], save_interval=2, sampling={"max_new_tokens": 8}
        )
        (spec_dir / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    schedule = {
        "events": [
            {"at": 0, "submit": "a.yaml"},
            {"at": 0, "submit": "b.yaml"},
            {"at": 0, "submit": "c.yaml"},  # 2 slots: waits PENDING until b's slot frees up
            {"when": {"adapter": "b", "step": 2}, "cancel": "b"},
        ]
    }
    path = spec_dir / "schedule.yaml"
    path.write_text(yaml.safe_dump(schedule))
    return path


def _env(ray_tmp: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MILES_RAY_TMPDIR=ray_tmp,
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        PYTHONPATH=str(REPO_ROOT),
        PYTHONUNBUFFERED="1",
    )
    env.pop("RAY_ADDRESS", None)
    return env


# the kill-and-resume schedule reads who is RUNNING when c checkpoints: synchronous steps keep the
# adapters in step (with per-adapter pace a fast adapter may finish first; resume of carried work is
# tested in test_continuous_rollout.py)
SYNC = ("rollout.max_staleness=0",)


def _start_service(
    out: Path, port: int, ray_tmp: str, log: Path, dp: int = 1, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    overrides = [
        f"model.dp={dp}",
        "model.source=tiny",
        "lora.num_slots=2",
        "lora.max_rank=8",
        f"trainer.output_dir={out}",
        f"controller.port={port}",
        "controller.idle_sleep_s=0.3",
        f"controller.reward_modules=[{REWARDS}]",  # the specs arrive over HTTP
        f"controller.dataset_roots=[{Path(TOY_PROMPTS).parent}]",
        "logging.wandb_mode=disabled",
        "logging.console=false",
        "logging.plot=false",
        *extra,
    ]
    with log.open("a") as fh:
        return subprocess.Popen(
            ["bash", str(SCRIPTS / "start_service.sh"), *overrides],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=_env(ray_tmp),
            start_new_session=True,  # its own process group: Ray's processes included
        )


def _ray_pids(ray_tmp: str) -> list[int]:
    """Processes of this test's Ray (raylet, gcs, workers): their command line names its temp dir,
    or, for workers that renamed themselves (``ray::TrainerWorker``), their environment does (the
    service runs with ``MILES_RAY_TMPDIR``, which every Ray process inherits)."""
    pids = []
    needle = ray_tmp.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            renamed = cmdline.startswith(b"ray::") and needle in (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or renamed:
            pids.append(int(entry.name))
    return pids


def _ray_gone(ray_tmp: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _ray_pids(ray_tmp):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _freeze(proc: subprocess.Popen, ray_tmp: str) -> list[int]:
    """SIGSTOP the service's process group and every process of its Ray: from here on no step,
    checkpoint or state write happens, so what is on disk is what a restart will find. Returns the
    Ray processes stopped one by one (some live outside the group)."""
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    pids = _ray_pids(ray_tmp)
    _signal_all(pids, signal.SIGSTOP)
    return pids


def _persisted_runs(out: Path) -> dict[str, dict[str, Any]]:
    """The controller's live runs as its state file holds them (what a restart resumes from)."""
    state = load_state(out / "controller")
    assert state is not None, "the controller wrote no state"
    return {run["name"]: run for run in state["runs"]}


def stop_service(service: subprocess.Popen, ray_tmp: str) -> list[int]:
    """Kill the service's process group if it still runs, then any process of this test's own Ray
    (by its temp dir); returns the Ray processes that had to be killed."""
    if service.poll() is None:
        _kill_group(service)
    leftover = [] if _ray_gone(ray_tmp) else _ray_pids(ray_tmp)
    for pid in leftover:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return leftover


def _wait_for(
    what: str, pred: Callable[[], Any], timeout_s: float, service: subprocess.Popen, log: Path
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = pred()
        except ControllerUnavailableError:
            value = None
        if value:
            return value
        if service.poll() is not None:
            pytest.fail(
                f"service exited ({service.returncode}) while waiting for {what}:\n{log.read_text()[-4000:]}"
            )
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


def _records(client: ControllerClient) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in client.list()}


def _metric_lines(out: Path) -> list[dict[str, Any]]:
    """The service's metrics.jsonl: one line per adapter and step, in the order they were logged."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _checkpoint_steps(out: Path, name: str) -> list[int]:
    return [int(ckpt.read_state(p)["step"]) for p in adapter_checkpoints(out, name)]


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dp1", "dp2"])
def test_service_schedule_kill_and_resume(tmp_path: Path, dp: int) -> None:
    out = tmp_path / "out"
    log = tmp_path / "service.log"
    runner_log = tmp_path / "schedule.log"
    schedule = _write_specs(tmp_path / "specs")
    ray_tmp = tempfile.mkdtemp(prefix="ray_svc_", dir="/tmp")  # short: Ray's socket paths are limited
    port = free_port()
    client = ControllerClient(f"http://127.0.0.1:{port}")
    service = _start_service(out, port, ray_tmp, log, dp, SYNC)
    runner = None
    try:
        with runner_log.open("w") as fh:
            runner = subprocess.Popen(
                ["bash", str(SCRIPTS / "submit_schedule.sh"), str(schedule), "--state-dir", str(out / "controller"),
                 "--wait", "--poll", "0.3", "--timeout", "400"],
                stdout=fh, stderr=subprocess.STDOUT, env={**_env(ray_tmp), "COLUMNS": "200"},
            )  # fmt: skip

        # Phase 1: a and b run, c waits PENDING; b is cancelled at step 2 and c takes its slot.
        def c_checkpointed() -> dict[str, dict[str, Any]] | None:
            recs = _records(client)
            c = recs.get("c")
            if c and c["state"] == "RUNNING" and (c["checkpoint_step"] or 0) >= 2:
                return recs
            return None

        seen_pending = _wait_for(
            "c to wait PENDING",
            lambda: _records(client).get("c", {}).get("state") == "PENDING",
            120,
            service,
            log,
        )
        assert seen_pending
        seen = _wait_for("c to checkpoint step 2", c_checkpointed, 240, service, log)
        # Hold the state the assertions read: the service may step or checkpoint again between the
        # look above and the kill, so freeze it, read what is on disk, then kill (a crash mid-run).
        frozen = _freeze(service, ray_tmp)
        before = _persisted_runs(out)
        logged_before_restart = len(_metric_lines(out))
        _kill_group(service)
        _signal_all(frozen, signal.SIGCONT)  # Ray's processes outside the group end as after any crash
        assert seen["b"]["state"] == "CANCELLED" and seen["b"]["step"] >= 2  # final: cannot change
        assert "b" not in before, "a cancelled run leaves the live state"
        assert before["a"]["state"] == before["c"]["state"] == "RUNNING", "a and c train when killed"
        assert _ray_gone(ray_tmp), f"Ray outlived the killed service: {_ray_pids(ray_tmp)}"
        resume_from = {n: before[n]["checkpoint_step"] for n in ("a", "c")}
        assert all(step >= 2 for step in resume_from.values()), resume_from
        for name in ("a", "c"):  # the last complete checkpoint on disk is the controller's resume point
            assert _checkpoint_steps(out, name)[-1] >= resume_from[name]

        # Phase 2: restart on the same output_dir: a and c resume without being resubmitted.
        service = _start_service(out, port, ray_tmp, log, dp, SYNC)
        _wait_for("the restarted controller", lambda: client.health()["status"] == "ok", 120, service, log)
        _wait_for(
            "every adapter to end",
            lambda: all(r["state"] in ("DONE", "CANCELLED") for r in _records(client).values()),
            300,
            service,
            log,
        )
        final = _records(client)
        assert {n: r["state"] for n, r in final.items()} == {"a": "DONE", "b": "CANCELLED", "c": "DONE"}
        for name, run_id in {
            "b": seen["b"]["run_id"],
            **{n: before[n]["run_id"] for n in ("a", "c")},
        }.items():
            assert final[name]["run_id"] == run_id, "no adapter was registered again"
        for name in ("a", "c"):
            assert final[name]["step"] == STEPS[name]
            after = _metric_lines(out)[logged_before_restart:]
            resumed = [m["step"] for m in after if m["adapter"] == name]
            # the first step after the restart continues from the checkpoint, not from 0
            assert resumed[0] == resume_from[name] + 1, (name, resumed, resume_from)
            assert sorted(set(resumed)) == list(range(resume_from[name] + 1, STEPS[name] + 1))
            assert _checkpoint_steps(out, name)[-1] == STEPS[name]
            assert final[name]["last_checkpoint"].endswith(layout.step_name(STEPS[name]))
        assert _checkpoint_steps(out, "b")[-1] == final["b"]["step"]  # drained: final checkpoint at cancel
        for name in ("a", "b", "c"):  # one shard per TP rank, whatever the number of DP ranks
            shards = sorted(p.name for p in adapter_checkpoints(out, name)[-1].glob("slot_rank*.pt"))
            assert shards == ["slot_rank0.pt"], (name, shards)

        # The schedule runner rode out the crash and saw every adapter end.
        assert runner.wait(timeout=60) == 0, runner_log.read_text()
        timeline = runner_log.read_text()
        assert "c: PENDING" in timeline and "cancel b" in timeline and "controller unreachable" in timeline
        assert f"finished: a=DONE@{STEPS['a']}, b=CANCELLED" in timeline and "c=DONE@6" in timeline

        # Graceful stop: SIGTERM ends the idle service cleanly, and its Ray goes with it.
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=90) == 0, log.read_text()[-4000:]
        assert "service stopped" in log.read_text()
        # the CLI and every Ray worker hide the known third-party notices, and say so once per start
        assert "not installed" not in log.read_text() and "is deprecated" not in log.read_text()
        assert log.read_text().count(third_party_noise.NOTE) == 2  # two starts
        assert _ray_gone(ray_tmp), f"Ray outlived the stopped service: {_ray_pids(ray_tmp)}"
    finally:
        if runner is not None and runner.poll() is None:
            runner.kill()
            runner.wait()
        leftover = stop_service(service, ray_tmp)
    assert not leftover, f"Ray processes left behind: {leftover}"


def _trainer_pids(ray_tmp: str) -> list[int]:
    """The trainer ranks of this test's Ray (they rename themselves ``ray::TrainerWorker...``)."""
    return [pid for pid in _ray_pids(ray_tmp) if _cmdline(pid).startswith(b"ray::TrainerWorker")]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_service_replaces_a_killed_trainer_three_times_and_loses_nothing(tmp_path: Path) -> None:
    """SIGKILL the trainer rank three times in a row while two adapters take turns in one slot (one
    of them parked off the GPU): the service replaces the group each time, counts it in /health,
    and both adapters resume from their checkpoints to their full budgets."""
    out, log = tmp_path / "out", tmp_path / "service.log"
    ray_tmp = tempfile.mkdtemp(prefix="ray_heal_", dir="/tmp")
    port = free_port()
    client = ControllerClient(f"http://127.0.0.1:{port}")
    turns = ("lora.num_slots=1", "controller.max_running=2", "controller.min_residency_steps=1")
    service = _start_service(out, port, ray_tmp, log, extra=("trainer.restart_backoff_s=0.2", *turns))
    steps = 6
    try:
        _wait_for("the controller", lambda: client.health()["status"] == "ok", 120, service, log)
        for name in ("a", "b"):
            spec = toy_adapter(
                name, "fraction_of_letter_a", steps=steps, save_interval=2, sampling={"max_new_tokens": 8}
            )
            client.submit(spec)
        _wait_for(
            "a checkpoint", lambda: (client.status("a")["checkpoint_step"] or 0) >= 2, 240, service, log
        )
        for kill in (1, 2, 3):
            pids = _wait_for("a trainer rank", lambda: _trainer_pids(ray_tmp), 120, service, log)
            _signal_all(pids, signal.SIGKILL)
            _wait_for(
                f"restart {kill}", lambda k=kill: client.health()["trainer_restarts"] >= k, 120, service, log
            )
        assert client.health()["trainer_restarts"] == 3
        for name in ("a", "b"):
            final = _wait_for(
                f"{name} to finish",
                lambda n=name: (r := client.status(n))["state"] in ("DONE", "FAILED") and r,
                300,
                service,
                log,
            )
            assert final["state"] == "DONE" and final["step"] == steps, final
            assert _checkpoint_steps(out, name)[-1] == steps
            trained = [m["step"] for m in _metric_lines(out) if m["adapter"] == name]
            assert sorted(set(trained)) == list(range(1, steps + 1)), trained  # every step, some twice
        assert any(client.status(n)["parked_s"] > 0 for n in ("a", "b"))  # they took turns
        assert log.read_text().count("trainer group lost") == 3
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        leftover = stop_service(service, ray_tmp)
    assert not leftover, f"Ray processes left behind: {leftover}"
