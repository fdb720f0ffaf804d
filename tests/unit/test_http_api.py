"""The controller HTTP API against a real server on 127.0.0.1, its client and the CLI commands."""

from __future__ import annotations

import http.client
import io
import json
import logging
import socket
import threading
import time
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import requests
import yaml
from rich.console import Console

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.config.safe_yaml import load_yaml_no_aliases
from miles_multilora.config.sections.controller import ControllerConfig
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
LIMITS = HTTPLimits.of(ControllerConfig())


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


def connect(url: str, timeout: float = 5) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def raw_exchange(url: str, data: bytes) -> tuple[int, dict]:
    """Send raw bytes, read until the server closes (it does after an error); (status, JSON body)."""
    with connect(url) as conn:
        conn.sendall(data)
        response = b""
        while chunk := conn.recv(65536):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture
def open_server():
    """Start servers without a token on 127.0.0.1; stops them after the test."""
    servers = []

    def start(core=None, **kwargs):
        servers.append(ControllerHTTPServer(core or ControllerCore(num_slots=1, max_rank=16), **kwargs))
        return servers[-1].start()

    yield start
    for server in servers:
        server.stop()


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


def test_json_registers_and_anything_else_is_415(served, auth):
    core, url = served
    response = requests.post(f"{url}/adapters", json=spec("j1"), headers=auth, timeout=5)
    assert response.status_code == 201
    body = response.json()
    assert (body["name"], body["state"], body["spec"]["dataset"]["task"]) == (
        "j1",
        "PENDING",
        "basic_arithmetic",
    )
    charset = {**auth, "Content-Type": "application/json; charset=utf-8"}
    assert (
        requests.post(f"{url}/adapters", data=json.dumps(spec("j2")), headers=charset, timeout=5).status_code
        == 201
    )

    before = core.list(all_runs=True)
    for body, content_type in [
        (yaml.safe_dump(spec("y1")), "application/yaml"),
        (json.dumps(spec("s1")), "text/plain"),  # what a cross-site form/fetch could send
        (yaml.safe_dump(spec("s2")), "text/plain"),
        (json.dumps(spec("f1")), "application/x-www-form-urlencoded"),
        (json.dumps(spec("n1")), None),
    ]:
        headers = {**auth, **({"Content-Type": content_type} if content_type else {})}
        response = requests.post(f"{url}/adapters", data=body.encode(), headers=headers, timeout=5)
        assert response.status_code == 415, (content_type, response.text)
        assert "application/json" in response.json()["error"] and response.headers["Connection"] == "close"
    assert core.list(all_runs=True) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (json.dumps(spec("big", rank=64)), "rank"),
        (json.dumps(spec("bad/name")), "name"),
        (json.dumps(spec("typo", num_stepz=3)), "num_stepz"),
        (json.dumps(spec("topk", sampling={"top_k": 10**30})), "sampling.top_k"),
        (json.dumps(spec("eps", optimizer={"eps": 0})), "optimizer.eps"),
        (json.dumps(spec("stop", sampling={"stop_token_ids": [2**40]})), "sampling.stop_token_ids[0]"),
        (json.dumps({**spec("x"), "name": True}), "name"),
        (json.dumps({**spec("x"), "name": 123}), "name"),
        (json.dumps(spec("tpl", prompt={"template": True})), "prompt.template"),
        (json.dumps(spec("re", reward={"type": "format", "format_regex": 5})), "reward.format_regex"),
        (json.dumps(spec("tenant", tenant=7)), "tenant"),
        ("{not json", "<body>"),
        ("[1, 2]", "<body>"),
        ('"/etc/passwd.yaml"', "<body>"),  # never read as a server-side path
        ("[" * 100_000, "<body>"),  # RecursionError in the parser
        ('{"a": ' * 40 + "1" + "}" * 40, "<body>"),  # parses, but nests too deep
        (json.dumps(spec("nan"))[:-1] + ', "x": NaN}', "<body>"),
        (b"\xff\xfe{}", "<body>"),
        ("", "<body>"),
    ],
)
def test_invalid_spec_is_400_naming_the_field(served, auth, body, field):
    core, url = served
    before = core.list(all_runs=True)
    headers = {**auth, "Content-Type": "application/json"}
    response = requests.post(f"{url}/adapters", data=body, headers=headers, timeout=5)
    assert response.status_code == 400, response.text
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


def test_oversized_body_is_413_before_it_is_read(open_server):
    core = ControllerCore(num_slots=1, max_rank=16)
    url = open_server(core, max_body_bytes=64)
    big = spec("x" * 60, prompt={"template": "y" * 200})
    assert requests.post(f"{url}/adapters", json=big, timeout=5).status_code == 413
    with pytest.raises(SpecError, match="413"):
        ControllerClient(url).submit(big)

    head = b"POST /adapters HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    # A huge Content-Length is refused at once, without waiting for the body.
    status, body = raw_exchange(url, head + b"Content-Length: 1000000000\r\n\r\n")
    assert status == 413 and "64 bytes" in body["error"]
    # A chunked body is refused as soon as it passes the limit, though it never ends.
    chunks = b"".join(b"20\r\n" + b"z" * 32 + b"\r\n" for _ in range(3))
    status, body = raw_exchange(url, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
    assert status == 413
    status, body = raw_exchange(url, head + b"\r\n")
    assert status == 411 and "Content-Length" in body["error"]
    assert core.list(all_runs=True) == []


def test_an_over_limit_body_gets_a_413_the_client_can_read(open_server):
    """A body past the limit (the controller's default, 1 MB) is answered 413 before it is read;
    the connection then reads and drops the rest, so a client still sending reads the answer (a
    plain http.client, which does not survive a reset connection, and requests)."""
    core = ControllerCore(num_slots=1, max_rank=16)
    url = open_server(core)
    big = spec("big", prompt={"template": "y" * (8 << 20)})  # more than the socket buffers take
    parts = urlsplit(url)
    for _ in range(3):
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        try:
            conn.request(
                "POST", "/adapters", body=json.dumps(big), headers={"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            assert response.status == 413
            assert "limit of 1048576 bytes" in json.loads(response.read())["error"]
        finally:
            conn.close()
    chunks = (b"z" * 65536 for _ in range(128))  # chunked: refused once past the limit
    response = requests.post(
        f"{url}/adapters", data=chunks, headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == 413 and "1048576 bytes" in response.json()["error"]
    with pytest.raises(SpecError, match="413"):
        ControllerClient(url).submit(big)
    assert core.list(all_runs=True) == []


def test_twenty_concurrent_registrations_all_succeed(served, auth):
    core, url = served
    names = [f"conc{i}" for i in range(20)]
    statuses: dict[str, int] = {}
    barrier = threading.Barrier(len(names))

    def submit(name: str) -> None:
        barrier.wait()
        statuses[name] = requests.post(
            f"{url}/adapters", json=spec(name), headers=auth, timeout=30
        ).status_code

    threads = [threading.Thread(target=submit, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == dict.fromkeys(names, 201)
    assert set(names) <= {r["name"] for r in core.list()}


def test_idle_connections_neither_block_requests_nor_stay_open(open_server):
    url = open_server(limits=replace(LIMITS, head_timeout_s=0.5))
    opened = time.monotonic()
    idle = [connect(url) for _ in range(60)]
    for conn in idle[:5]:  # headers trickled in but never finished count as idle too
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
    try:  # served although 60 connections sit idle (no thread or slot held per connection)
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        for conn in idle:
            assert conn.recv(1) == b""  # closed by the server (the timeout of connect() is 5 s)
        assert time.monotonic() - opened < 0.5 + 10  # the head deadline, plus slack for a loaded machine
    finally:
        for conn in idle:
            conn.close()


def test_a_full_server_closes_idle_connections_and_refuses_with_503_only_when_none_is_idle(open_server):
    url = open_server(limits=replace(LIMITS, max_connections=3, max_connections_per_peer=3))
    idle = [connect(url) for _ in range(3)]
    try:  # the oldest idle connection makes room
        assert requests.get(f"{url}/health", timeout=5).status_code == 200
        assert idle[0].recv(1) == b""
    finally:
        for conn in idle:
            conn.close()
    time.sleep(0.3)  # the server has seen them close
    busy = []  # requests in flight: their bodies never end
    for _ in range(3):
        busy.append(connect(url))
        busy[-1].sendall(b"POST /adapters HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # fmt: skip
        time.sleep(0.1)  # in flight before the next connection comes (else it is idle, and closed for it)
    try:
        assert requests.get(f"{url}/health", timeout=5).status_code == 503
        with pytest.raises(ControllerUnavailableError, match="503"):
            ControllerClient(url).health()
    finally:
        for conn in busy:
            conn.close()
    deadline = time.monotonic() + 5
    while requests.get(f"{url}/health", timeout=5).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert requests.get(f"{url}/health", timeout=5).status_code == 200


def test_token_rules_at_start(caplog):
    core = ControllerCore(num_slots=1, max_rank=16)
    with pytest.raises(ConfigError, match="empty"):
        ControllerHTTPServer(core, token="")
    with socket.socket() as busy:  # the token check must come before binding (this port is taken)
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        with pytest.raises(ConfigError) as info:
            ControllerHTTPServer(core, host="0.0.0.0", port=busy.getsockname()[1]).start()
        assert info.value.key == "controller.token"
        assert "MILES_MULTILORA_TOKEN" in info.value.message and "controller.token_file" in info.value.message
        with pytest.raises(ConfigError) as info:
            ControllerHTTPServer(core, port=busy.getsockname()[1], token=TOKEN).start()
        assert info.value.key == "controller.port"

    caplog.set_level(logging.WARNING, logger="miles_multilora.controller.http_api")
    server = ControllerHTTPServer(core)
    try:
        url = server.start()
        assert server.start() == url  # already started: no second warning
        warnings = [  # this logger only: other libraries' threads (an SDK heartbeat) may warn meanwhile
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "miles_multilora.controller.http_api"
        ]
        assert len(warnings) == 1
        assert "any local process" in warnings[0] and "MILES_MULTILORA_TOKEN" in warnings[0]
    finally:
        server.stop()
        server.stop()  # idempotent
    with pytest.raises(ControllerUnavailableError):  # stopped: the port no longer answers
        ControllerClient(url, timeout_s=2).health()


def test_docs_and_health_are_open_with_a_token(served):
    core, url = served
    spec_ = requests.get(f"{url}/openapi.json", timeout=5)
    assert spec_.status_code == 200
    paths = spec_.json()["paths"]
    assert set(paths["/adapters"]) == {"get", "post"} and set(paths["/adapters/{name}"]) == {"get", "delete"}
    assert "/health" in paths
    assert requests.get(f"{url}/docs", timeout=5).status_code == 200
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    assert requests.get(f"{url}/adapters", timeout=5).status_code == 401


class _SpyCore(ControllerCore):
    """Records how register is called; ``list`` fails like an unexpected bug would; ``health``
    holds a NaN (strict JSON has none)."""

    def __init__(self) -> None:
        super().__init__(num_slots=1, max_rank=16)
        self.remote_flags: list[bool] = []

    def register(self, spec_source, *, remote=False):
        self.remote_flags.append(remote)
        return super().register(spec_source, remote=remote)

    def list(self, all_runs=False):
        raise RuntimeError("disk on fire")

    def health(self):
        return {**super().health(), "load": float("nan")}


def test_posted_specs_are_remote_and_unexpected_errors_are_500(open_server, caplog):
    core = _SpyCore()
    url = open_server(core)
    assert requests.post(f"{url}/adapters", json=spec("r1"), timeout=5).status_code == 201
    assert core.remote_flags == [True]
    with caplog.at_level(logging.ERROR, logger="miles_multilora.controller.http_api"):
        response = requests.get(f"{url}/adapters", timeout=5)
    assert response.status_code == 500 and "disk on fire" in response.json()["error"]
    assert any(r.exc_info for r in caplog.records)  # logged with the traceback
    assert requests.get(f"{url}/adapters/r1", timeout=5).json()["state"] == "PENDING"  # still serving
    health = requests.get(f"{url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["load"] is None


def test_client_parses_yaml_locally_and_refuses_aliases(tmp_path):
    client = ControllerClient(closed_port_url(), timeout_s=2)  # any request would fail to connect
    bomb = "a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nname: [*c, *c]\n"
    anchored = tmp_path / "anchored.yaml"
    anchored.write_text("name: &n x\nnum_steps: 5\ndataset: {task: basic_arithmetic}\n")
    for source in (bomb, anchored):
        with pytest.raises(SpecError) as info:
            client.submit(source)
        assert info.value.key == "<spec>" and "aliases" in info.value.message
    for source in ("- a\n- list\n", "name: [unclosed"):
        with pytest.raises(SpecError, match="<spec>"):
            client.submit(source)
    assert load_yaml_no_aliases("a: [1, {b: c}]") == {"a": [1, {"b": "c"}]}


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
