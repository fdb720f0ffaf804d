"""No accepted input can stall the service, end to end (HTTP -> controller -> trainer ranks):

- poisoned specs are refused at registration with the key named (temperature, template
  placeholders, a reasoning-gym task whose generation blows its bounds);
- a catastrophically backtracking ``format_regex`` beside a healthy adapter: the bad one ends
  FAILED at its timeout with the reason, the healthy one keeps stepping;
- a reward timeout above ``controller.max_reward_timeout_s`` is refused; a reward that never
  returns (at the cap) holds no step: the healthy adapter steps on, SIGTERM stops the service
  within 10 s;
- after the restart nothing freezes again: the FAILED adapter stays failed, the hanging one is cut
  by ``trainer.reward_step_timeout_s`` and FAILED, the healthy one resumes.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from miles_multilora.controller.client import ControllerClient
from miles_multilora.errors import SpecError
from miles_multilora.models.compat import free_port
from tests.e2e.conftest import REWARDS, TOY_PROMPTS, toy_adapter
from tests.e2e.test_service import SCRIPTS, _env, _metric_lines, _records, _wait_for, stop_service
from tests.e2e.test_stuck_adapters import BACKTRACKS

LONG = 100_000  # steps of the long-running adapters (never reached)


def _start(out: Path, port: int, ray_tmp: str, log: Path, *extra: str) -> subprocess.Popen:
    overrides = [
        "model.source=tiny",
        "lora.num_slots=3",
        "lora.max_rank=8",
        f"trainer.output_dir={out}",
        f"controller.port={port}",
        "controller.idle_sleep_s=0.3",
        f"controller.reward_modules=[{REWARDS}]",
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
            start_new_session=True,
        )


def _refused(url: str) -> None:
    base = toy_adapter("poison", "fraction_of_letter_a", steps=2)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sampling": {"temperature": 1e-40, "max_new_tokens": 8}}, "sampling.temperature"),
        ({"prompt": {"template": "{question:>100000000}"}}, "prompt.template"),
        ({"prompt": {"template": "{question:>1000000000000000}"}}, "prompt.template"),
        ({"prompt": {"template": "{question.__class__.__mro__}"}}, "prompt.template"),
        ({"prompt": {"template": "{question!r}"}}, "prompt.template"),
        ({"prompt": {"template": "{question[0]}"}}, "prompt.template"),
        ({"dataset": {"task": "count_primes", "task_params": {"max_n": 100_000_000}}}, "dataset.task_params"),
    ]
    for override, key in cases:
        start = time.perf_counter()
        response = requests.post(f"{url}/adapters", json={**base, **override}, timeout=60)
        assert response.status_code == 400, (override, response.status_code, response.text)
        assert response.json()["field"] == key, (override, response.json())
        assert time.perf_counter() - start < 15, override  # the generation bound, not 13 s + 0.9 GB


def _started_by_the_service(ray_tmp: str) -> list[int]:
    """Every live process whose environment names this test's Ray temp dir: the service, Ray, the
    trainer ranks and whatever they started (reward processes and their forkserver included)."""
    needle = f"MILES_RAY_TMPDIR={ray_tmp}".encode()
    found = []
    for pid in psutil.pids():
        try:
            if (
                needle in Path(f"/proc/{pid}/environ").read_bytes()
                and psutil.Process(pid).status() != "zombie"
            ):
                found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


def _steps_of(out: Path, name: str, since: int = 0) -> list[int]:
    return [m["step"] for m in _metric_lines(out)[since:] if m["adapter"] == name]


def test_nothing_a_spec_does_stalls_the_service_or_its_stop(tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "service.log"
    ray_tmp = tempfile.mkdtemp(prefix="ray_stop_", dir="/tmp")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = ControllerClient(url)
    service = _start(out, port, ray_tmp, log)
    try:
        _wait_for("the controller", lambda: client.health()["status"] == "ok", 120, service, log)
        client.submit(
            toy_adapter("healthy", "fraction_of_letter_a", steps=LONG, sampling={"max_new_tokens": 8})
        )
        regex = toy_adapter("regex", "fraction_of_letter_a", steps=LONG, sampling={"max_new_tokens": 48})
        regex["reward"] = {
            "type": "format",
            "format_regex": BACKTRACKS,
            "timeout_s": 2,
            "max_consecutive_failures": 1,
        }
        client.submit(regex)

        def regex_failed_and_healthy_stepped_on() -> dict[str, Any] | None:
            recs = _records(client)
            if recs["regex"]["state"] != "FAILED":
                return None
            return recs if recs["healthy"]["step"] >= 3 else None

        _wait_for("healthy to step", lambda: _records(client)["healthy"]["step"] >= 1, 120, service, log)
        _refused(url)  # (the controller's child-process forkserver is warm by now)
        assert sorted(_records(client)) == ["healthy", "regex"]
        recs = _wait_for(
            "regex to fail, healthy to step on", regex_failed_and_healthy_stepped_on, 180, service, log
        )
        assert "reward.timeout_s" in recs["regex"]["reason"], recs["regex"]["reason"]
        assert recs["healthy"]["state"] == "RUNNING"

        sleepy = toy_adapter("sleepy", "sleeps_forever", steps=LONG, sampling={"max_new_tokens": 8})
        sleepy["reward"].update(timeout_s=3600, max_consecutive_failures=1)
        with pytest.raises(SpecError, match="controller.max_reward_timeout_s") as refused:
            client.submit(sleepy)  # above the operator's cap (60 s): a 400
        assert refused.value.key == "reward.timeout_s"
        sleepy["reward"].update(timeout_s=60)
        client.submit(sleepy)
        _wait_for("sleepy to run", lambda: _records(client)["sleepy"]["state"] == "RUNNING", 60, service, log)
        held = _records(client)["healthy"]["step"]
        # sleepy's reward is out for 60 s: the steps go on without it (trainer.reward_wait_s)
        _wait_for(
            "healthy to step on", lambda: _records(client)["healthy"]["step"] >= held + 3, 60, service, log
        )
        assert _records(client)["sleepy"]["step"] == 0

        start = time.perf_counter()  # nothing holds the step in flight: the stop is prompt
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert time.perf_counter() - start < 10.0, (time.perf_counter() - start, log.read_text()[-3000:])

        logged = len(_metric_lines(out))
        service = _start(out, port, ray_tmp, log, "trainer.reward_step_timeout_s=3")

        def sleepy_failed_and_healthy_resumed() -> dict[str, Any] | None:
            recs = _records(client)
            ok = recs["sleepy"]["state"] == "FAILED" and len(_steps_of(out, "healthy", logged)) >= 2
            return recs if ok else None

        recs = _wait_for(
            "the restarted service to go on", sleepy_failed_and_healthy_resumed, 180, service, log
        )
        assert "trainer.reward_step_timeout_s" in recs["sleepy"]["reason"], recs["sleepy"]["reason"]
        assert recs["regex"]["state"] == "FAILED" and recs["healthy"]["state"] == "RUNNING"
        assert not _steps_of(out, "regex", logged)

        start = time.perf_counter()  # a graceful stop: the step ends, moved adapters are checkpointed
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert time.perf_counter() - start < 20.0  # its checkpoint writes took 10.3 s on a loaded 2-core box
    finally:
        leftover = stop_service(service, ray_tmp)
    assert not leftover, f"Ray processes left behind: {leftover}"
    deadline = time.monotonic() + 20
    while _started_by_the_service(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _started_by_the_service(ray_tmp), "processes of the service (reward processes?) outlived it"


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MILES_MULTILORA_TOKEN", raising=False)
