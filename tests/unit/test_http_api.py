"""The controller HTTP API against a real server on 127.0.0.1, its client and the CLI commands."""

from __future__ import annotations

import io
import json
import socket

import pytest
import requests
import yaml
from rich.console import Console

from miles_multilora.controller import (
    AdapterConflictError,
    ControllerAuthError,
    ControllerCore,
    ControllerUnavailableError,
    IllegalTransitionError,
    UnknownAdapterError,
)
from miles_multilora.controller.client import ControllerClient
from miles_multilora.controller.commands import run_command
from miles_multilora.controller.endpoint import write_endpoint
from miles_multilora.controller.http_api import ControllerHTTPServer
from miles_multilora.errors import ConfigError, SpecError

TOKEN = "s3cret-token"


def spec(name: str, **overrides) -> dict:
    return {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 5, **overrides}


@pytest.fixture(scope="module")
def served():
    core = ControllerCore(num_slots=1, max_rank=16)
    server = ControllerHTTPServer(core, port=0, token=TOKEN)
    url = server.start()
    yield core, url
    server.stop()


@pytest.fixture
def auth():
    return {"Authorization": f"Bearer {TOKEN}"}


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_server_reports_the_ephemeral_port_and_health_is_open(served):
    core, url = served
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    response = requests.get(f"{url}/health", timeout=5)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    assert response.json()["num_slots"] == 1 and response.json()["status"] == "ok"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_missing_or_wrong_token_is_401_and_registers_nothing(served, headers):
    core, url = served
    before = core.list(all_runs=True)
    assert requests.get(f"{url}/adapters", headers=headers, timeout=5).status_code == 401
    response = requests.post(f"{url}/adapters", json=spec("sneaky"), headers=headers, timeout=5)
    assert response.status_code == 401 and "token" in response.json()["error"]
    assert core.list(all_runs=True) == before


def test_submit_yaml_json_and_sniffed_bodies(served, auth):
    core, url = served
    response = requests.post(
        f"{url}/adapters",
        data=yaml.safe_dump(spec("y1")),
        headers={**auth, "Content-Type": "application/yaml"},
        timeout=5,
    )
    assert response.status_code == 201
    body = response.json()
    assert (body["name"], body["state"], body["spec"]["dataset"]["task"]) == (
        "y1",
        "PENDING",
        "basic_arithmetic",
    )
    assert requests.post(f"{url}/adapters", json=spec("j1"), headers=auth, timeout=5).status_code == 201
    for text in (json.dumps(spec("s1")), yaml.safe_dump(spec("s2"))):
        response = requests.post(
            f"{url}/adapters", data=text, headers={**auth, "Content-Type": "text/plain"}, timeout=5
        )
        assert response.status_code == 201, response.text
    assert {"y1", "j1", "s1", "s2"} <= {r["name"] for r in core.list()}


@pytest.mark.parametrize(
    ("body", "content_type", "field"),
    [
        (json.dumps(spec("big", rank=64)), "application/json", "rank"),
        (json.dumps(spec("bad/name")), "application/json", "name"),
        (json.dumps(spec("typo", num_stepz=3)), "application/json", "num_stepz"),
        ("{not json", "application/json", "<body>"),
        ("name: [unclosed", "application/yaml", "<body>"),
        ("- a\n- list\n", "application/yaml", "<body>"),
        ("/etc/passwd.yaml", "text/plain", "<body>"),  # never read as a server-side path
    ],
)
def test_invalid_spec_is_400_naming_the_field(served, auth, body, content_type, field):
    core, url = served
    before = core.list(all_runs=True)
    response = requests.post(
        f"{url}/adapters", data=body, headers={**auth, "Content-Type": content_type}, timeout=5
    )
    assert response.status_code == 400
    assert field in response.json()["field"] and response.json()["error"]
    assert core.list(all_runs=True) == before


def test_get_list_cancel_and_404_409(served, auth):
    core, url = served
    assert requests.post(f"{url}/adapters", json=spec("dup"), headers=auth, timeout=5).status_code == 201
    duplicate = requests.post(f"{url}/adapters", json=spec("dup"), headers=auth, timeout=5)
    assert duplicate.status_code == 409 and "dup" in duplicate.json()["error"]

    listing = requests.get(f"{url}/adapters", headers=auth, timeout=5)
    assert listing.status_code == 200 and "dup" in {r["name"] for r in listing.json()["adapters"]}
    one = requests.get(f"{url}/adapters/dup", headers=auth, timeout=5)
    assert (
        one.status_code == 200 and one.json()["state"] == "PENDING" and one.json()["spec"]["num_steps"] == 5
    )

    for method in ("GET", "DELETE"):
        missing = requests.request(method, f"{url}/adapters/ghost", headers=auth, timeout=5)
        assert missing.status_code == 404 and "ghost" in missing.json()["error"]
    assert requests.get(f"{url}/nowhere", headers=auth, timeout=5).status_code == 404
    assert requests.put(f"{url}/adapters", headers=auth, timeout=5).status_code == 405

    cancelled = requests.delete(f"{url}/adapters/dup", headers=auth, timeout=5)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"
    again = requests.delete(f"{url}/adapters/dup", headers=auth, timeout=5)
    assert again.status_code == 409 and again.json()["type"] == "IllegalTransitionError"
    assert requests.post(f"{url}/adapters", json=spec("dup"), headers=auth, timeout=5).status_code == 201
    runs = requests.get(f"{url}/adapters?all_runs=1", headers=auth, timeout=5).json()["adapters"]
    assert [r["state"] for r in runs if r["name"] == "dup"] == ["CANCELLED", "PENDING"]


def test_running_adapter_cancel_over_http_drains(served, auth):
    core, url = served
    requests.post(f"{url}/adapters", json=spec("drainme"), headers=auth, timeout=5)
    for record in core.list():  # free the single slot for "drainme" (FIFO would pick older ones)
        if record["state"] == "PENDING" and record["name"] != "drainme":
            core.cancel(record["name"])
        elif record["state"] == "RUNNING":
            core.mark_done(record["name"])
    for slot in core.snapshot().slots_to_clear:
        core.slot_cleared(slot)
    assert [a.name for a in core.snapshot().running] == ["drainme"]
    response = requests.delete(f"{url}/adapters/drainme", headers=auth, timeout=5)
    assert response.status_code == 200 and response.json()["state"] == "DRAINING"


def test_oversized_body_is_413(auth):
    core = ControllerCore(num_slots=1, max_rank=16)
    server = ControllerHTTPServer(core, max_body_bytes=64)
    url = server.start()
    try:
        response = requests.post(
            f"{url}/adapters", json=spec("x" * 60, prompt={"template": "y" * 200}), timeout=5
        )
        assert response.status_code == 413 and core.list() == []
    finally:
        server.stop()


def test_client_round_trip_and_errors_map_back_to_their_classes(served, tmp_path):
    core, url = served
    client = ControllerClient(url, token=TOKEN)
    spec_file = tmp_path / "client_a.yaml"
    spec_file.write_text(yaml.safe_dump(spec("client_a")))
    assert client.submit(spec_file)["state"] == "PENDING"
    assert client.submit(yaml.safe_dump(spec("client_text")))["name"] == "client_text"
    assert client.submit(spec("client_b"))["name"] == "client_b"
    assert client.status("client_a")["spec"]["name"] == "client_a"
    assert {"client_a", "client_b"} <= {r["name"] for r in client.list()}
    assert client.cancel("client_b")["state"] == "CANCELLED"
    assert client.health()["status"] == "ok"

    with pytest.raises(SpecError) as info:
        client.submit(spec("client_c", rank=999))
    assert info.value.key == "rank" and "max_rank" in info.value.message
    with pytest.raises(AdapterConflictError):
        client.submit(spec_file)
    with pytest.raises(UnknownAdapterError, match="ghost"):
        client.status("ghost")
    with pytest.raises(IllegalTransitionError):
        client.cancel("client_b")
    with pytest.raises(ControllerAuthError, match="401"):
        ControllerClient(url, token="wrong").list()
    with pytest.raises(ControllerUnavailableError, match="cannot reach"):
        ControllerClient(closed_port_url(), timeout_s=2).health()


def test_client_from_env_and_endpoint_file(served, tmp_path, monkeypatch):
    core, url = served
    monkeypatch.delenv("MILES_MULTILORA_URL", raising=False)
    monkeypatch.setenv("MILES_MULTILORA_TOKEN", TOKEN)
    write_endpoint(tmp_path, url, "multilora_controller", "miles_multilora")
    assert ControllerClient.from_env(state_dir=tmp_path).health()["status"] == "ok"
    monkeypatch.setenv("MILES_MULTILORA_URL", url)
    assert isinstance(ControllerClient.from_env().list(), list)
    monkeypatch.delenv("MILES_MULTILORA_URL")
    with pytest.raises(ConfigError, match="controller.url"):
        ControllerClient.from_env()
    with pytest.raises(ControllerUnavailableError, match="endpoint"):
        ControllerClient.from_env(state_dir=tmp_path / "absent")


def test_commands_print_tables_and_return_exit_codes(served, tmp_path):
    core, url = served
    out = io.StringIO()
    console = Console(file=out, width=200)
    spec_file = tmp_path / "cmd_a.yaml"
    spec_file.write_text(yaml.safe_dump(spec("cmd_a")))
    common = {"url": url, "token": TOKEN}
    assert run_command("submit", {"specs": [str(spec_file)], **common}, console) == 0
    assert "submitted cmd_a" in out.getvalue()
    core.snapshot()
    assert run_command("list", common, console) == 0 and "cmd_a" in out.getvalue()

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec("bad", rank=500)))
    assert run_command("submit", {"specs": str(bad), **common}, console) == 1
    assert "rank" in out.getvalue().splitlines()[-1]
    assert run_command("status", {"name": "ghost", **common}, console) == 1
    assert run_command("status", {"name": "cmd_a", **common}, console) == 0
    assert run_command("cancel", {"name": "cmd_a", **common}, console) == 0
    assert run_command("status", {**common}, console) == 1 and "missing 'name'" in out.getvalue()
    assert run_command("list", {"url": closed_port_url()}, console) == 2
    assert run_command("frobnicate", {}, console) == 1
