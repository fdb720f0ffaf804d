"""A STAND-IN for an SGLang server, for tests and CPU demos: it is not SGLang and runs no model.

It implements the small part of SGLang's HTTP API that :class:`~miles_multilora.rollout.sglang_engine.
SGLangEngine` uses (``GET /health``, ``POST /generate``, ``POST /load_lora_adapter``,
``POST /unload_lora_adapter``) with the same request and response shapes, and answers ``/generate``
with deterministic fake tokens: a hash of (prompt, LoRA name, seed). It records every adapter load and
unload and every generate payload so tests can check what a client did. Errors mimic SGLang's:
HTTP 400 with ``{"success": false, "error_message": ...}`` (or ``{"error": {"message": ...}}`` on
``/generate``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class SGLangStandIn:
    """Stand-in SGLang server on ``127.0.0.1``; use as a context manager or call start/stop.

    Fake tokenizer: token ``t`` decodes to ``chr(ord("a") + t % 26)``; ``eos_token_id`` ends a
    generation with ``finish_reason {"type": "stop", "matched": eos_token_id}``.
    """

    def __init__(self, vocab_size: int = 64, eos_token_id: int = 1, port: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.loaded: dict[str, str] = {}
        self.events: list[tuple[str, str]] = []  # ("load" | "unload", lora_name)
        self.generate_payloads: list[dict[str, Any]] = []
        self.fail_generate: str | None = None  # set to make /generate answer 500 with this message
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SGLangStandIn:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Shut the server down (idempotent)."""
        if self._thread is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> SGLangStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ endpoints
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def load(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, {"success": False, "error_message": "lora_name and lora_path are required"}
        if not (Path(path) / "adapter_config.json").is_file():
            return 400, {"success": False, "error_message": f"no adapter_config.json in {path}"}
        with self._lock:
            if name in self.loaded:
                return 400, {"success": False, "error_message": f"LoRA adapter {name} is already loaded"}
            self.loaded[name] = path
            self.events.append(("load", name))
            return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.loaded)}

    def unload(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("lora_name")
        with self._lock:
            if name not in self.loaded:
                return 400, {"success": False, "error_message": f"LoRA adapter {name} is not loaded"}
            del self.loaded[name]
            self.events.append(("unload", name))
            return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.loaded)}

    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.generate_payloads.append(body)
            lora, failing = body.get("lora_path"), self.fail_generate
        if failing:
            return 500, {"error": {"message": failing}}
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "input_ids must be a non-empty list of ints"}}
        if lora is not None and lora not in self.loaded:
            return 400, {"error": {"message": f"LoRA adapter {lora} is not loaded"}}
        seed = params.get("sampling_seed", 0) if params.get("temperature", 1.0) > 0 else 0
        stops = params.get("stop") or []
        out: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": params.get("max_new_tokens", 16)}
        state = json.dumps([ids, lora, seed]).encode()
        for _ in range(int(params.get("max_new_tokens", 16))):
            state = hashlib.sha256(state).digest()
            out.append(int.from_bytes(state[:4], "little") % self.vocab_size)
            if out[-1] == self.eos_token_id:
                finish = {"type": "stop", "matched": self.eos_token_id}
                break
            text = self.decode(out)
            hit = next((s for s in stops if s in text), None)
            if hit is not None:
                finish = {"type": "stop", "matched": hit}
                break
        logprobs = [[-0.05 * (1 + t % 9), t, None] for t in out]
        meta = {
            "id": hashlib.md5(state).hexdigest(),
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "output_token_logprobs": logprobs,
        }
        return 200, {"text": self.decode(out), "output_ids": out, "meta_info": meta}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path == "/health":
                    self._reply(200, {})
                else:
                    self._reply(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                routes = {
                    "/generate": standin.generate,
                    "/load_lora_adapter": standin.load,
                    "/unload_lora_adapter": standin.unload,
                }
                if self.path not in routes:
                    self._reply(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                except json.JSONDecodeError as exc:
                    self._reply(400, {"error": {"message": f"invalid JSON: {exc}"}})
                    return
                self._reply(*routes[self.path](body))

        return Handler
