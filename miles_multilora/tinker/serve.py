"""Start the Tinker server: its trainer rank in this process (or, with ``model.dp`` > 1, the backend
of rank 0 that :mod:`miles_multilora.launch.tinker_ranks` started with its followers), its batching
queue, the HTTP app (served by :mod:`miles_multilora.http_serving`, like the controller's API) and a
housekeeping thread that expires silent sessions and releases old results."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.types import Scope

from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError
from miles_multilora.http_serving import LOOPBACK_HOSTS, BackgroundServer
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue
from miles_multilora.tinker.server import create_app
from miles_multilora.tinker.state import ServerState
from miles_multilora.tinker.tenants import KeyRing, read_key_file

logger = logging.getLogger(__name__)


@dataclass
class TinkerServer:
    """A running server (``url``); ``stop()`` ends it, its housekeeping and its queue, and frees
    its slots (the trainer rank can serve a new server in this process)."""

    url: str
    state: ServerState
    http: BackgroundServer
    keys: KeyRing
    _stop: threading.Event = field(default_factory=threading.Event)
    _housekeeping: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.http.alive

    def stop(self) -> None:
        self._stop.set()
        self.state.stopping.set()
        self.http.stop()
        if self._housekeeping is not None:
            self._housekeeping.join(timeout=10)
        self.state.queue.close()
        backend = self.state.backend
        if not getattr(backend, "healthy", True):  # a follower rank died: the unloads run on rank 0 alone
            backend.stop()
        for model_id in list(backend.models):  # nothing outlives the server but saved states
            backend.unload_model(model_id)
        for copy in list(backend.copies):  # sampling copies: their weights are on disk
            backend.drop_copy(copy)
        if hasattr(backend, "stop"):  # the follower ranks of a multi-rank server
            backend.stop()


def make_backend(rank: Any, offload_dir: Path | None = None) -> TinkerBackend:
    """The backend of one trainer rank, sized by its config's ``tinker`` section."""
    t = rank.cfg.tinker
    return TinkerBackend(
        rank, max_models=t.max_models, offload_host_bytes=int(t.offload_host_gb * (1 << 30)),
        offload_dir=offload_dir,
    )  # fmt: skip


def _one_rank(cfg: RunConfig) -> Any:
    # builds the model: imported when a server starts
    from miles_multilora.trainer.auto_slots import sized_config
    from miles_multilora.trainer.rank import TrainerRank

    return TrainerRank(sized_config(cfg))


def build_state(cfg: RunConfig, rank: Any | None = None, backend: Any | None = None) -> ServerState:
    """The server's state over ``backend`` (rank 0's of several trainer ranks:
    :func:`miles_multilora.launch.tinker_ranks.start`), else over a backend on the given single
    rank or on one trainer rank built from ``cfg`` here."""
    if backend is None:
        world = cfg.trainer.world_size
        if world not in (None, 1) and rank is not None:
            raise ConfigError(
                "trainer.world_size", "a given trainer rank serves alone; use trainer.world_size=1"
            )
        if world not in (None, 1):
            raise ConfigError(
                "trainer.world_size",
                f"{world} trainer ranks start from miles_multilora.launch.tinker_ranks.start (as tinker-serve "
                "does)",
            )
        backend = make_backend(rank if rank is not None else _one_rank(cfg))
    t = cfg.tinker
    base = t.base_model or (cfg.model.hf_path if cfg.model.source == "hf" else cfg.model.source)
    return ServerState(
        backend,
        BatchingQueue(
            backend,
            window_s=t.batch_window_s,
            lone_after_s=t.batch_window_alone_s,
            batch_tokens=t.batch_tokens,
            sample_batch_tokens=t.sample_batch_tokens,
            batch_sampling=t.batch_sampling,
            join_sampling=t.join_sampling,
        ),
        base_model=str(base),
        state_dir=Path(t.state_dir or Path(cfg.trainer.output_dir) / "tinker"),
        tokenizer_id=t.tokenizer_id,
        settings=t,
    )


def read_keys(cfg: RunConfig) -> KeyRing:
    """The tenants' keys (``tinker.api_key_file``); none is allowed on a loopback host only."""
    t = cfg.tinker
    if t.host not in LOOPBACK_HOSTS and not t.api_key_file:
        raise ConfigError("tinker.api_key_file", f"binding {t.host} needs an API key file (tml-... keys)")
    return KeyRing(read_key_file(t.api_key_file) if t.api_key_file else None)


def start(
    cfg: RunConfig, rank: Any | None = None, port: int | None = None, backend: Any | None = None
) -> TinkerServer:
    """Serve in a background thread (on ``backend``, ``rank`` or a rank built here:
    :func:`build_state`); returns once the socket accepts connections."""
    t = cfg.tinker
    keys = read_keys(cfg)
    state = build_state(cfg, rank, backend)

    def authenticate(scope: Scope) -> str | None:
        return keys.tenant_of(dict(scope["headers"]).get(b"x-api-key"))

    http = BackgroundServer(
        create_app(state, authenticate=authenticate), t.host, t.port if port is None else port,
        name="tinker-http", port_key="tinker.port", logger=logger, limits=HTTPLimits.of(t),
    )  # fmt: skip
    try:
        url = http.start(timeout_s=60)
    except BaseException:
        state.queue.close()
        raise
    server = TinkerServer(url, state, http, keys)
    period = min(1.0, t.session_timeout_s / 4)

    def housekeeping() -> None:
        while not server._stop.wait(period):
            try:
                state.maintain()
            except Exception:  # noqa: BLE001 - keep expiring sessions whatever one of them did
                logger.exception("tinker: housekeeping failed")

    server._housekeeping = threading.Thread(target=housekeeping, name="tinker-housekeeping", daemon=True)
    server._housekeeping.start()
    if keys.open:
        logger.warning("tinker server on %s has no API key file: every local process is one tenant", url)
    return server
