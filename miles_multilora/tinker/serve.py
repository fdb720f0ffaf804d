"""Start the Tinker server: one in-process trainer rank, its batching queue and the HTTP app."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from miles_multilora.config.run import RunConfig
from miles_multilora.controller.token import read_token
from miles_multilora.errors import ConfigError
from miles_multilora.tinker.backend import BatchingQueue, TinkerBackend
from miles_multilora.tinker.server import ServerState, create_app


@dataclass
class TinkerServer:
    """A running server (``url``); ``stop()`` ends it and its queue."""

    url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.state.queue.close()


def build_state(cfg: RunConfig, worker: Any | None = None) -> ServerState:
    """The backend on a trainer rank built from ``cfg`` (or the given one)."""
    if cfg.trainer.world_size not in (None, 1):
        raise ConfigError(
            "trainer.world_size", "tinker-serve runs one trainer rank; use trainer.world_size=1"
        )
    if worker is None:
        from miles_multilora.trainer.worker import TrainerWorker

        worker = TrainerWorker(cfg)
    backend = TinkerBackend(worker)
    t = cfg.tinker
    base = t.base_model or (cfg.model.hf_path if cfg.model.source == "hf" else cfg.model.source)
    return ServerState(
        backend,
        BatchingQueue(backend, window_s=t.batch_window_s),
        base_model=str(base),
        state_dir=Path(t.state_dir or Path(cfg.trainer.output_dir) / "tinker"),
        tokenizer_id=t.tokenizer_id,
    )


def start(cfg: RunConfig, worker: Any | None = None, port: int | None = None) -> TinkerServer:
    """Serve in a background thread; returns once the socket accepts connections."""
    t = cfg.tinker
    if t.host not in ("127.0.0.1", "localhost", "::1") and not t.api_key_file:
        raise ConfigError("tinker.api_key_file", f"binding {t.host} needs an API key file (tml-... key)")
    api_key = read_token(t.api_key_file, key="tinker.api_key_file") if t.api_key_file else None
    if api_key is not None and not api_key.startswith("tml-"):
        raise ConfigError("tinker.api_key_file", "the Tinker SDK only sends keys that start with 'tml-'")
    state = build_state(cfg, worker)
    app = create_app(state, api_key=api_key, max_body_bytes=t.max_body_mb * 2**20)
    port = t.port if port is None else port
    server = uvicorn.Server(
        uvicorn.Config(app, host=t.host, port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="tinker-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            state.queue.close()
            raise RuntimeError(f"the Tinker server did not start on {t.host}:{port}")
        time.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1] if port == 0 else port
    return TinkerServer(f"http://{t.host}:{bound}", state, server, thread)


def serve_forever(cfg: RunConfig, console: Any) -> None:
    """``miles-multilora tinker-serve``: serve until SIGINT/SIGTERM."""
    import signal

    console.print("starting the trainer rank (loading the model) ...")
    server = start(cfg)
    console.print(
        f"[bold]miles_multilora tinker server[/bold] at {server.url}: base_model={server.state.base_model!r}, "
        f"{cfg.lora.num_slots} slots (one per client model), max LoRA rank {cfg.lora.max_rank}; clients: "
        f"tinker.ServiceClient(base_url={server.url!r}, api_key='tml-...')",
        soft_wrap=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0) and server.thread.is_alive():
        pass
    server.stop()
    console.print("tinker server stopped")
