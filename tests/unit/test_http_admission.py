"""Connection and request admission of both front doors (:mod:`miles_multilora.http_serving`), on
real servers bound to 127.0.0.1 with clients on other loopback addresses: idle and trickling
sockets of one address cannot starve a keyed client of another, a request head has a deadline
whatever keep-alive says, requests without credentials cannot take the share kept for callers with
them; and two fixes of the Tinker door (a non-ASCII download token is a 403; polling a result keeps
its session alive)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import resource
import select
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import requests
from fastapi import FastAPI

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.config.sections.controller import ControllerConfig
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.http_api import ControllerHTTPServer
from miles_multilora.http_serving import BackgroundServer, Guard
from miles_multilora.tinker.server import render

TOKEN, KEY = "s3cret-token", "tml-tenant-a"
IDLE_FROM, TRICKLE_FROM, CLIENT_FROM = "127.0.0.2", "127.0.0.3", "127.0.0.4"
IDLE_SOCKETS, TRICKLE_SOCKETS, KEYED_REQUESTS = 300, 40, 100
API = "/api/v1"
logger = logging.getLogger(__name__)


@dataclass
class Door:
    """A server under test and the keyed request its legitimate client sends."""

    port: int
    path: str
    headers: dict[str, str]


def connect(port: int, source: str = "127.0.0.1", timeout: float = 5) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))


def closed_by_server(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionError:
        return True


@pytest.fixture(scope="module")
def service_door() -> Iterator[Door]:
    server = ControllerHTTPServer(ControllerCore(num_slots=1, max_rank=16), port=0, token=TOKEN)
    url = server.start()
    yield Door(int(url.rsplit(":", 1)[1]), "/adapters", {"Authorization": f"Bearer {TOKEN}"})
    server.stop()


@pytest.fixture(scope="module")
def tinker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``tinker-serve`` on the tiny model (no request here trains), silent sessions ending after 1 s."""
    from miles_multilora.config.run import config_from_container
    from miles_multilora.models import compat
    from miles_multilora.tinker.serve import start

    root = tmp_path_factory.mktemp("tinker_admission")
    keys = root / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    cfg = config_from_container({
        "model": {"source": "tiny"},
        "lora": {"num_slots": 2, "max_rank": 8},
        "trainer": {"output_dir": str(root / "out")},
        "tinker": {"port": 0, "api_key_file": str(keys), "base_model": "tiny", "session_timeout_s": 1.0},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    server = start(cfg)
    try:
        yield server
    finally:
        server.stop()
        compat.destroy_distributed()


@pytest.fixture(scope="module")
def tinker_door(tinker_server: Any) -> Door:
    return Door(
        int(tinker_server.url.rsplit(":", 1)[1]), f"{API}/get_server_capabilities", {"X-API-Key": KEY}
    )


class Attack:
    """``IDLE_SOCKETS`` silent sockets from ``IDLE_FROM`` and ``TRICKLE_SOCKETS`` from
    ``TRICKLE_FROM`` that trickle a request head (a byte per socket every 0.1 s); every 0.1 s the
    sockets the server closed are opened again, until stopped (at most 20 s)."""

    def __init__(self, port: int) -> None:
        self.port, self.reopened, self.error = port, 0, None
        self.ready, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="attack", daemon=True)

    def __enter__(self) -> Attack:
        self.thread.start()
        assert self.ready.wait(30), "the attack could not open its sockets"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert self.error is None, f"the attack failed: {self.error!r}"

    def _open(self, source: str, selector: selectors.BaseSelector, sent: dict[socket.socket, int]) -> None:
        try:
            conn = connect(self.port, source, timeout=2)
        except OSError:
            return
        conn.setblocking(False)
        selector.register(conn, selectors.EVENT_READ, source)
        sent[conn] = 0

    def _run(self) -> None:
        try:
            self._attack()
        except BaseException as exc:  # reported by __exit__
            self.error = exc
            self.ready.set()

    def _attack(self) -> None:
        selector, sent = selectors.DefaultSelector(), {}
        lost = {IDLE_FROM: IDLE_SOCKETS, TRICKLE_FROM: TRICKLE_SOCKETS}
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        deadline, tick = time.monotonic() + 20, 0.0
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                if time.monotonic() >= tick:
                    tick = time.monotonic() + 0.1
                    for source, n in lost.items():
                        for _ in range(n):
                            self._open(source, selector, sent)
                    self.reopened += sum(lost.values())
                    lost = dict.fromkeys(lost, 0)
                    self.ready.set()
                    for key in list(selector.get_map().values()):
                        conn = key.fileobj
                        if key.data == TRICKLE_FROM and isinstance(conn, socket.socket):
                            with contextlib.suppress(OSError):
                                sent[conn] += conn.send(head[sent[conn] : sent[conn] + 1])
                for key, _ in selector.select(timeout=0.02):
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    try:
                        if conn.recv(4096):
                            continue  # (a 503 before the close)
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    selector.unregister(conn)  # closed by the server
                    sent.pop(conn, None)
                    conn.close()
                    lost[key.data] += 1
        finally:
            for conn in sent:
                conn.close()
            selector.close()


def keyed_latencies(door: Door, n: int) -> tuple[list[float], Counter[str]]:
    """Seconds each of ``n`` keyed requests from ``CLIENT_FROM`` took (a new connection each;
    infinite for one that failed or was refused), and why those failed."""
    out, failures = [], Counter[str]()
    for _ in range(n):
        started, why = time.monotonic(), None
        conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=5, source_address=(CLIENT_FROM, 0))
        try:
            conn.request("GET", door.path, headers=door.headers)
            response = conn.getresponse()
            response.read()
            why = None if response.status == 200 else str(response.status)
        except OSError as exc:
            why = type(exc).__name__
        finally:
            conn.close()
        if why is not None:
            failures[why] += 1
        out.append(time.monotonic() - started if why is None else float("inf"))
    return out, failures


@pytest.mark.parametrize("door_name", ["service_door", "tinker_door"])
def test_idle_and_trickling_sockets_cannot_starve_a_keyed_client(
    door_name: str, request: pytest.FixtureRequest
) -> None:
    door: Door = request.getfixturevalue(door_name)  # the door's default limits
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # the server raised it if it could
    if soft < 3 * (IDLE_SOCKETS + TRICKLE_SOCKETS) + 256:
        pytest.skip(f"the open-file limit ({soft}) is too low for this test's sockets")
    assert keyed_latencies(door, 1)[0][0] < 5  # warm
    with Attack(door.port) as attack:
        latencies, failures = keyed_latencies(door, KEYED_REQUESTS)
    served = sum(seconds <= 1.0 for seconds in latencies)
    assert served >= 0.99 * KEYED_REQUESTS, (served, failures, sorted(latencies)[-5:], attack.reopened)


@pytest.fixture
def controller_server() -> Iterator[Any]:
    """Start controller API servers (no token) with given limits; stopped after the test."""
    servers: list[ControllerHTTPServer] = []

    def start(**limits: Any) -> int:
        server = ControllerHTTPServer(
            ControllerCore(num_slots=1, max_rank=16),
            limits=replace(HTTPLimits.of(ControllerConfig()), **limits),
        )
        servers.append(server)
        return int(server.start().rsplit(":", 1)[1])

    yield start
    for server in servers:
        server.stop()


def test_a_request_head_must_be_complete_within_head_timeout_whatever_keep_alive(controller_server) -> None:
    port = controller_server(head_timeout_s=0.5, keep_alive_s=30)
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    kept.request("GET", "/health")
    assert kept.getresponse().read()
    opened = time.monotonic()
    silent, trickling = connect(port), connect(port)
    trickling.setblocking(False)
    head, closed_after = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, None
    for i in range(len(head)):  # a byte every 0.05 s: never complete, never silent for long
        readable, _, _ = select.select([trickling], [], [], 0.05)
        if readable or not _sends(trickling, head[i : i + 1]):
            closed_after = time.monotonic() - opened
            break
    assert closed_after is not None and 0.4 <= closed_after < 0.5 + 2.5, closed_after
    silent.settimeout(5)
    assert closed_by_server(silent)
    # between requests the connection stays open for keep_alive_s (longer than a head may take)
    kept.request("GET", "/health")
    assert kept.getresponse().status == 200
    for conn in (silent, trickling, kept):
        conn.close()


def test_a_peer_past_its_cap_and_a_full_server_close_idle_connections_of_the_biggest_holder(
    controller_server,
) -> None:
    port = controller_server(max_connections=5, max_connections_per_peer=3)
    first = [connect(port, IDLE_FROM) for _ in range(3)]
    fourth = connect(port, IDLE_FROM)  # past its address's cap: its own oldest idle one goes
    assert closed_by_server(first[0])
    others = [connect(port, TRICKLE_FROM) for _ in range(2)]  # the server is full now (5)
    time.sleep(0.1)
    keyed = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(CLIENT_FROM, 0))
    keyed.request("GET", "/health")  # room made by the address holding most (IDLE_FROM, 3)
    assert keyed.getresponse().status == 200
    assert closed_by_server(first[1])
    for conn in others:  # the other address's connections were left alone
        conn.settimeout(0.2)
        with pytest.raises(TimeoutError):
            conn.recv(1)
    for conn in [*first, fourth, *others, keyed]:
        conn.close()


def _sends(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.send(data)
    except OSError:
        return False
    return True


def test_requests_in_flight_are_shared_anonymous_ones_cannot_take_the_keyed_share() -> None:
    """max_requests=6, max_anonymous_requests=2, max_requests_per_key=3: two anonymous requests in
    flight leave four for keyed ones, of which one key takes three; past any cap a request gets 503
    with Retry-After, naming the cap."""
    release, entered = threading.Event(), []
    app = FastAPI()

    async def wait() -> dict[str, bool]:
        entered.append(1)
        while not release.is_set():
            await asyncio.sleep(0.01)
        return {"ok": True}

    app.get("/open/wait")(wait)
    app.get("/wait")(wait)
    app.get("/hello")(lambda: {"ok": True})
    limits = replace(HTTPLimits(), max_requests=6, max_anonymous_requests=2, max_requests_per_key=3)
    tenants = {KEY.encode(): "a", b"tml-tenant-b": "b"}
    app.add_middleware(
        Guard, render=render, logger=logger, limits=limits, open_paths=("/open/wait",),
        authenticate=lambda scope: tenants.get(dict(scope["headers"]).get(b"x-api-key", b"")),
    )  # fmt: skip
    server = BackgroundServer(
        app, "127.0.0.1", 0, name="guarded", port_key="port", logger=logger, limits=limits
    )
    url, key_a, key_b = server.start(), {"X-API-Key": KEY}, {"X-API-Key": "tml-tenant-b"}
    statuses: list[int] = []

    def call(path: str, headers: dict[str, str] | None = None) -> None:
        statuses.append(requests.get(f"{url}{path}", headers=headers, timeout=30).status_code)

    def in_flight(path: str, n: int, headers: dict[str, str] | None = None) -> list[threading.Thread]:
        threads = [threading.Thread(target=call, args=(path, headers)) for _ in range(n)]
        goal = len(entered) + n
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(entered) < goal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(entered) == goal
        return threads

    def refused(path: str, headers: dict[str, str] | None, cap: str) -> None:
        response = requests.get(f"{url}{path}", headers=headers, timeout=5)
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert f"({cap})" in response.json()["detail"]

    try:
        threads = in_flight("/open/wait", 2)
        refused("/open/wait", None, "max_anonymous_requests")
        assert requests.get(f"{url}/hello", headers=key_a, timeout=5).status_code == 200  # kept for keys
        threads += in_flight("/wait", 3, key_a)
        refused("/hello", key_a, "max_requests_per_key")
        threads += in_flight("/wait", 1, key_b)  # another key still has room
        refused("/hello", key_b, "max_requests")
        release.set()
        for thread in threads:
            thread.join(timeout=10)
        assert statuses == [200] * 6
        assert requests.get(f"{url}/hello", headers=key_a, timeout=5).status_code == 200
    finally:
        release.set()
        server.stop()


# ---------------------------------------------------------------------------- Tinker door fixes
def test_a_download_token_that_is_not_ascii_is_a_403(tinker_server: Any) -> None:
    for token in ("a.%C3%A9", "%C3%A9.abc", "%FF.%FE", "no-dot", ""):
        response = requests.get(f"{tinker_server.url}{API}/checkpoint_files?token={token}", timeout=5)
        assert response.status_code == 403, (token, response.text)
        assert "not a valid download link" in response.json()["detail"]


def test_polling_a_result_keeps_its_session_alive(tinker_server: Any) -> None:
    """A raw client (no heartbeats) polls a request that waits longer than the session timeout
    (1 s here): the session stays open and the request completes."""
    url, keyed, state = tinker_server.url, {"X-API-Key": KEY}, tinker_server.state
    session = requests.post(f"{url}{API}/create_session", json={}, headers=keyed, timeout=10).json()[
        "session_id"
    ]
    gate = threading.Event()
    state.queue.submit_calls(("t-other", "s"), [lambda: gate.wait(20)])  # the queue is busy for 3 s
    timer = threading.Timer(3.0, gate.set)
    timer.start()
    try:
        body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
        rid = requests.post(f"{url}{API}/create_model", json=body, headers=keyed, timeout=10).json()[
            "request_id"
        ]
        started, result = time.monotonic(), None
        while time.monotonic() - started < 15:
            response = requests.post(
                f"{url}{API}/retrieve_future", json={"request_id": rid}, headers=keyed, timeout=30
            )
            if response.status_code != 408:  # 408: not ready yet, poll again
                result = response.json()
                break
        assert time.monotonic() - started >= 2.0  # the session was silent but for the polls
        assert result is not None and "model_id" in result, result
        beat = requests.post(
            f"{url}{API}/session_heartbeat", json={"session_id": session}, headers=keyed, timeout=10
        )
        assert beat.status_code == 200
    finally:
        gate.set()
        timer.cancel()
        requests.post(f"{url}{API}/sessions/{session}/finish", json={}, headers=keyed, timeout=10)


def test_the_limits_are_checked_at_start() -> None:
    from miles_multilora.config.run import config_from_container
    from miles_multilora.errors import ConfigError

    base = {"model": {"source": "tiny"}}
    for section, values, key in (
        ("tinker", {"max_connections": 10}, "tinker.max_connections_per_peer"),
        ("controller", {"max_anonymous_requests": 2000}, "controller.max_anonymous_requests"),
        ("controller", {"head_timeout_s": 0}, "controller.head_timeout_s"),
        ("tinker", {"linger_s": -1}, "tinker.linger_s"),
    ):
        with pytest.raises(ConfigError) as info:
            config_from_container({**base, section: values})
        assert info.value.key == key
    cfg = config_from_container(base)
    assert cfg.controller.max_body_mb == 1 and cfg.tinker.max_body_mb == 64
    assert HTTPLimits.of(cfg.tinker) == HTTPLimits()


def test_a_port_still_held_by_the_server_being_replaced_is_bound_once_it_is_free() -> None:
    """A restarted service binds its fixed port while the server it replaces is still exiting: the
    bind is tried again (up to BIND_RETRY_S) instead of failing the new service at once."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    threading.Timer(0.5, holder.close).start()
    app = FastAPI()
    app.get("/hello")(lambda: {"ok": True})
    server = BackgroundServer(
        app, "127.0.0.1", port, name="again", port_key="port", logger=logger, limits=HTTPLimits()
    )
    try:
        url = server.start()
        assert url.endswith(f":{port}")
        assert requests.get(f"{url}/hello", timeout=10).json() == {"ok": True}
    finally:
        server.stop()
