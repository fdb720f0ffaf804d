"""What the LoRA server stand-ins share: a threaded HTTP server on 127.0.0.1, the loaded adapters,
switches that simulate server trouble, and deterministic fake tokens. Not a model, not a server
product: subclasses speak one real server's HTTP API (:mod:`.sglang_standin`, :mod:`.vllm_standin`).

Switches: ``lora_enabled`` (False: started without LoRA), ``max_loras`` (adapters it can hold),
``refuse`` (adapter -> the message a load of any of its versions is refused with), ``fail_generate``
(generation answers 500), ``fail_next_loads`` (that many loads answer 503), :meth:`restart` (every loaded adapter is lost), :meth:`hold` /
:meth:`release` (generation waits, so requests stay in flight).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

Reply = tuple[int, Any]  # (status, JSON body, or text for a str)
Route = Callable[[dict[str, Any]], Reply]


class LoRAStandIn:
    """A stand-in LoRA server; use as a context manager or call start/stop.

    Fake tokenizer: token ``t`` decodes to ``chr(ord("a") + t % 26)``; ``eos_token_id`` ends a
    generation. Tokens are a hash chain of (prompt, adapter name, seed): the same request gives the
    same tokens, another adapter version or seed other tokens.
    """

    def __init__(self, vocab_size: int = 64, eos_token_id: int = 1, port: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.loaded: dict[str, str] = {}  # name -> path
        self.events: list[tuple[str, str]] = []  # ("load" | "unload" | "restart", name)
        self.served: list[str | None] = []  # the adapter name each generation was served with
        self.peak_versions: dict[str, int] = {}  # adapter -> most of its versions loaded at once
        self.lora_enabled = True
        self.max_loras: int | None = None
        self.refuse: dict[str, str] = {}
        self.fail_generate: str | None = None
        self.fail_next_loads = 0  # the next loads answer 503 (a busy or restarting server)
        self.in_flight = 0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LoRAStandIn:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Shut the server down (idempotent)."""
        if self._thread is None:
            return
        self._open.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> LoRAStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self) -> None:
        """Back to a fresh server with default switches (tests sharing one server call it)."""
        with self._lock:
            self.loaded.clear()
            self.events.clear()
            self.served.clear()
            self.peak_versions.clear()
            self.lora_enabled, self.max_loras, self.refuse, self.fail_generate = True, None, {}, None
            self.fail_next_loads = 0
        self._open.set()

    # ------------------------------------------------------------- switches
    def restart(self) -> None:
        """Simulate a restart: every loaded adapter is lost."""
        with self._lock:
            self.loaded.clear()
            self.events.append(("restart", ""))

    def hold(self) -> None:
        """Generation requests wait (stay in flight) until :meth:`release`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait_in_flight(self, count: int = 1, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.in_flight < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} requests not in flight after {timeout_s}s")
            time.sleep(0.01)

    # -------------------------------------------------------- shared logic
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def _adapter(self, name: str) -> str:
        return name.rpartition("@v")[0] or name

    def take_load_failure(self) -> bool:
        """Under the lock: whether this load answers 503 (``fail_next_loads``)."""
        if self.fail_next_loads <= 0:
            return False
        self.fail_next_loads -= 1
        return True

    def check_load(self, name: str, path: str) -> str | None:
        """Under the lock: why a load of ``name`` is refused (None: it may load). Subclasses word
        the refusals as their server does (``lora_disabled_message`` ...)."""
        if not self.lora_enabled:
            return self.lora_disabled_message
        refused = self.refuse.get(self._adapter(name))
        if refused:
            return refused
        if self.max_loras is not None and len(self.loaded) >= self.max_loras:
            return self.full_message(name, path)
        return None

    lora_disabled_message = "LoRA is not enabled"

    def full_message(self, name: str, path: str) -> str:
        return f"no room for {name}"

    def has_adapter_files(self, path: str) -> bool:
        return (Path(path) / "adapter_config.json").is_file()

    def add(self, name: str, path: str) -> None:
        """Under the lock: ``name`` is loaded."""
        self.loaded[name] = path
        self.events.append(("load", name))
        adapter = self._adapter(name)
        count = sum(1 for n in self.loaded if self._adapter(n) == adapter)
        self.peak_versions[adapter] = max(self.peak_versions.get(adapter, 0), count)

    def drop(self, name: str) -> None:
        """Under the lock: ``name`` is unloaded."""
        del self.loaded[name]
        self.events.append(("unload", name))

    def enter_generation(self, lora: str | None) -> None:
        """A generation request arrives: wait while held; record what it is served with."""
        with self._lock:
            self.in_flight += 1
        self._open.wait()
        with self._lock:
            self.served.append(lora)

    def leave_generation(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def fake_tokens(
        self, ids: list[int], lora: str | None, seed: int, max_new: int, stops: list[str], stop_ids: list[int]
    ) -> tuple[list[int], str, Any]:
        """(tokens, finish, matched): finish ``"length"`` | ``"eos"`` | ``"stop_id"`` | ``"stop"``."""
        out: list[int] = []
        state = json.dumps([ids, lora, seed]).encode()
        for _ in range(max_new):
            state = hashlib.sha256(state).digest()
            out.append(int.from_bytes(state[:4], "little") % self.vocab_size)
            if out[-1] == self.eos_token_id:
                return out, "eos", self.eos_token_id
            if out[-1] in stop_ids:
                return out, "stop_id", out[-1]
            text = self.decode(out)
            hit = next((s for s in stops if s in text), None)
            if hit is not None:
                return out, "stop", hit
        return out, "length", None

    @staticmethod
    def logprob(token: int) -> float:
        return -0.05 * (1 + token % 9)

    # ----------------------------------------------------------------- http
    def routes(self) -> dict[tuple[str, str], Route]:
        """(method, path) -> handler of the JSON body."""
        raise NotImplementedError

    def not_found(self, path: str) -> Reply:
        return 404, {"detail": "Not Found"}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: one request per connection, none outlive stop()
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _reply(self, status: int, body: Any) -> None:
                if isinstance(body, str):
                    data, kind = body.encode(), "text/plain; charset=utf-8"
                else:
                    data, kind = json.dumps(body).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                route = standin.routes().get((method, self.path))
                if route is None:
                    self._reply(*standin.not_found(self.path))
                    return
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError as exc:
                    self._reply(400, {"error": {"message": f"invalid JSON: {exc}"}})
                    return
                self._reply(*route(body))

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                self._handle("POST")

        return Handler
