"""Service safety end to end, through the real path (HTTP -> controller actor -> trainer ranks):

- a spec from the network may not run code the operator did not register (refused before import);
- specs that used to be accepted and then crash the trainer are refused (400) or end FAILED alone
  while a healthy adapter keeps training;
- names cannot collide on disk; a re-registered name gets its own checkpoint directory;
- after a SIGKILL, an adapter whose resume checkpoint is unreadable resumes from the newest
  readable one, and one with none readable fails alone: the service always comes up.
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from miles_multilora.controller.client import ControllerClient
from miles_multilora.models.compat import free_port
from miles_multilora.rl import checkpoint_layout as layout
from tests.e2e.conftest import REPO_ROOT, REWARDS, TOY_PROMPTS, toy_adapter
from tests.e2e.test_service import (
    _env,
    _kill_group,
    _metric_lines,
    _ray_gone,
    _ray_pids,
    _wait_for,
    stop_service,
)

SCRIPTS = REPO_ROOT / "examples" / "multi_lora"
DATA = Path(TOY_PROMPTS).parent
LONG = 100_000  # steps of the long-running adapters (never reached: the test stops the service first)


def _start(out: Path, port: int, ray_tmp: str, log: Path, canary: Path) -> subprocess.Popen:
    overrides = [
        "model.source=tiny",
        "lora.num_slots=4",
        "lora.max_rank=8",
        f"trainer.output_dir={out}",
        "trainer.keep_checkpoints=3",
        f"controller.port={port}",
        "controller.idle_sleep_s=0.3",
        f"controller.reward_modules=[{REWARDS}]",
        f"controller.dataset_roots=[{DATA}]",
        "logging.wandb_mode=disabled",
        "logging.console=false",
        "logging.plot=false",
    ]
    env = {**_env(ray_tmp), "MILES_TEST_IMPORT_CANARY": str(canary)}
    with log.open("a") as fh:
        return subprocess.Popen(
            ["bash", str(SCRIPTS / "start_service.sh"), *overrides],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _post(url: str, spec: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/adapters", json=spec, timeout=60)


def _records(client: ControllerClient) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in client.list()}


def _steps(out: Path, name: str) -> list[int]:
    run = layout.latest_run_dir(out, name)
    return [int(p.name.removeprefix("step_")) for p in layout.complete_checkpoints(run)] if run else []


def _spoil(checkpoint: Path) -> None:
    """Keep the COMPLETE marker but make the shard unreadable (a torn or corrupted file)."""
    (checkpoint / "slot_rank0.pt").write_bytes(b"not a torch file")


def _refusals(url: str, canary: Path) -> None:
    """Specs refused at registration (400 naming the key), with nothing registered or imported."""
    cases = [
        (toy_adapter("rce", "x", steps=2) | {"reward": {"type": "os:system"}}, "reward.type"),
        (toy_adapter("canary", "x", steps=2) | {"reward": {"type": "tests.e2e.import_canary:touch"}}, "reward.type"),
        (toy_adapter("unregistered", "_share", steps=2), "reward.type"),  # listed module, not decorated
        (toy_adapter(".", "fraction_of_letter_a", steps=2), "name"),
        (toy_adapter("..", "fraction_of_letter_a", steps=2), "name"),
        (toy_adapter("-dash", "fraction_of_letter_a", steps=2), "name"),
        (toy_adapter("long", "fraction_of_letter_a", steps=2, sampling={"max_new_tokens": 10_000}), "sampling.max_new_tokens"),
        (toy_adapter("hub", "fraction_of_letter_a", steps=2, dataset={"path": "someone/no-such-dataset"}), "dataset.path"),
        (toy_adapter("outside", "fraction_of_letter_a", steps=2, dataset={"path": "/etc/hostname.jsonl"}), "dataset.path"),
        (toy_adapter("infinite", "fraction_of_letter_a", steps=2, optimizer={"lr": 1e300}), "optimizer.lr"),
        (toy_adapter("topk", "fraction_of_letter_a", steps=2, sampling={"top_k": 0}), "sampling.top_k"),
        (toy_adapter("many", "fraction_of_letter_a", steps=2, n_samples_per_prompt=10**7), "n_samples_per_prompt"),
    ]  # fmt: skip
    for spec, field in cases:
        response = _post(url, spec)
        assert response.status_code == 400, (spec["name"], response.status_code, response.text)
        assert response.json()["field"] == field, (spec["name"], response.json())
    big = toy_adapter("big", "fraction_of_letter_a", steps=2)
    big["reward"]["kwargs"] = {"table": list(range(200_000))}  # ~1.3 MB: over the body limit too
    start = time.perf_counter()
    assert _post(url, big).status_code in (400, 413)
    big["reward"]["kwargs"] = {"table": list(range(5_000))}  # under the body limit, over the kwargs cap
    response = _post(url, big)
    assert response.status_code == 400 and response.json()["field"] == "reward.kwargs", response.text
    assert time.perf_counter() - start < 5
    assert not canary.exists(), f"the controller imported a module named by a request: {canary.read_text()}"


def test_bad_specs_fail_alone_names_never_collide_and_restart_falls_back(tmp_path: Path) -> None:
    out, log, canary = tmp_path / "out", tmp_path / "service.log", tmp_path / "imported"
    ray_tmp = tempfile.mkdtemp(prefix="ray_safe_", dir="/tmp")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = ControllerClient(url)
    service = _start(out, port, ray_tmp, log, canary)
    try:
        _wait_for("the controller", lambda: client.health()["status"] == "ok", 120, service, log)
        _refusals(url, canary)
        assert client.list() == []

        steady = {"save_interval": 2, "sampling": {"max_new_tokens": 8}}
        client.submit(toy_adapter("healthy", "fraction_of_letter_a", steps=LONG, **steady))
        client.submit(toy_adapter("doomed", "fraction_of_lowercase", steps=LONG, **steady))
        huge = toy_adapter("huge", "huge_reward", steps=LONG, **steady)
        huge["reward"]["max_consecutive_failures"] = 1
        client.submit(huge)
        bad_rows = {"path": str(DATA / "bad_rows.jsonl"), "shuffle": False}
        client.submit(
            toy_adapter(
                "bad_rows", "fraction_of_letter_a", steps=LONG, dataset=bad_rows,
                prompt={"template": "{question}:"}, **steady,
            )
        )  # fmt: skip

        def broken_ones_failed() -> dict[str, dict[str, Any]] | None:
            recs = _records(client)
            ok = all(recs[n]["state"] == "FAILED" for n in ("huge", "bad_rows"))
            return recs if ok and recs["healthy"]["step"] >= 2 else None

        recs = _wait_for("the broken adapters to fail", broken_ones_failed, 180, service, log)
        assert "out of range" in recs["huge"]["reason"], recs["huge"]["reason"]
        assert "prompts" in recs["bad_rows"]["reason"] and "'question' is null" in recs["bad_rows"]["reason"]
        assert recs["healthy"]["state"] == recs["doomed"]["state"] == "RUNNING"

        # The same name twice: each run keeps its own directory and checkpoints.
        for _ in range(2):
            client.submit(toy_adapter("again", "fraction_of_letter_a", steps=2, save_interval=1))
            _wait_for(
                "again to finish", lambda: _records(client)["again"]["state"] == "DONE", 120, service, log
            )
        runs = sorted(p.name for p in layout.adapter_dir(out, "again").iterdir())
        assert len(runs) == 2, runs
        for run in runs:
            steps = [p.name for p in layout.complete_checkpoints(layout.adapter_dir(out, "again") / run)]
            assert steps == ["step_000001", "step_000002"], (run, steps)
        assert not (out / "checkpoints" / "step_000001").exists()

        _wait_for(
            "healthy to keep 3 checkpoints", lambda: len(_steps(out, "healthy")) == 3, 180, service, log
        )
        _kill_group(service)
        assert _ray_gone(ray_tmp), f"Ray outlived the killed service: {_ray_pids(ray_tmp)}"

        # Spoil every checkpoint of "healthy" but its oldest, and every one of "doomed".
        healthy_run = layout.latest_run_dir(out, "healthy")
        kept = layout.complete_checkpoints(healthy_run)
        for path in kept[1:]:
            _spoil(path)
        for path in layout.complete_checkpoints(layout.latest_run_dir(out, "doomed")):
            _spoil(path)
        fallback = int(kept[0].name.removeprefix("step_"))
        logged = len(_metric_lines(out))

        service = _start(out, port, ray_tmp, log, canary)

        def resumed() -> dict[str, dict[str, Any]] | None:
            recs = _records(client)
            new = [m for m in _metric_lines(out)[logged:] if m["adapter"] == "healthy"]
            return recs if recs["doomed"]["state"] == "FAILED" and len(new) >= 2 else None

        recs = _wait_for("the restarted service to resume", resumed, 180, service, log)
        assert "no readable checkpoint" in recs["doomed"]["reason"], recs["doomed"]["reason"]
        new_steps = [m["step"] for m in _metric_lines(out)[logged:] if m["adapter"] == "healthy"]
        assert new_steps[:2] == [fallback + 1, fallback + 2], (fallback, new_steps)
        assert recs["healthy"]["state"] == "RUNNING"
        assert not canary.exists()
        history = [
            json.loads(x) for x in (out / "controller" / "controller_history.jsonl").read_text().splitlines()
        ]
        assert {e["name"] for e in history} >= {"huge", "bad_rows", "again", "doomed"}

        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        leftover = stop_service(service, ray_tmp)
    assert not leftover, f"Ray processes left behind: {leftover}"


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MILES_MULTILORA_TOKEN", raising=False)
