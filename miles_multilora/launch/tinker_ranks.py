"""The Tinker server over several trainer ranks (``trainer.world_size`` > 1: DP, and TP within it).

Rank 0 is the server's process: its HTTP app, queue and backend. Every other rank is a process of
its own, started here with the rank wiring the RL door's actors get (:mod:`.wiring`), that builds
the same trainer rank and backend and then only *follows*: each backend operation (every public
method of :class:`~miles_multilora.tinker.backend.TinkerBackend` not marked
:func:`~miles_multilora.tinker.backend.reads`: a model created, loaded, trained, stepped, parked,
sampled ...) is broadcast from rank 0 before rank 0 runs it, and every follower runs the same call
on its own backend. A new operation is mirrored by default; nothing lists them by hand. The
trainer rank's operations are SPMD already (:class:`~miles_multilora.trainer.rank.TrainerRank`):
under DP a forward/backward trains each rank's share of the rows and sums the slots' gradients in
``optim_step``, and a sampling call generates each rank's share of the requests and gathers the
results, so clients' work is spread over the ranks while every rank's slots stay identical.
Reads (a model's slot, the held models, a request's checks) stay on rank 0. Files are written by
the ranks the trainer rank names as writers; each rank parks its slots under its own offload
directory.

A sample call with joins (the queue's ``more``) runs on every rank's engine stream in lockstep
(:func:`~miles_multilora.trainer.stream_sampling.sample_lockstep`): the ranks agree at every host
check, and join when rank 0's queue has work for the running call. Rank 0 then runs that work
(training of models whose inflight samplers' rows decode, sample parts joining) between two
decode steps, and mirrors it as it goes: each operation it calls is broadcast to the followers,
which run it too, inside their own sample call (:class:`FollowedJoins`), then the sample requests
that join. So rows keep their KV cache on every rank and sample their next tokens with the
stepped weights, as on one rank.

The operations reach rank 0's backend from one thread (the queue's worker; at shutdown, the
stopping thread after the queue has closed), and a lock keeps broadcast and run together, so every
rank runs them in the same order. A follower whose call raises goes on: rank 0 runs the same
deterministic code and answers the client with the same error.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError
from miles_multilora.launch.wiring import local_rendezvous, rank_env
from miles_multilora.rollout import RolloutError
from miles_multilora.tinker import serve
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.operations import operations
from miles_multilora.tinker.requests import SampleJoiner, SampleRequest
from miles_multilora.trainer.auto_slots import sized_config
from miles_multilora.trainer.rank import TrainerRank

logger = logging.getLogger(__name__)

OPERATIONS = operations(TinkerBackend)  # what every rank runs (the backend's unmarked public methods)
_STOP = "__stop__"
_CALLBACKS = ("on_done", "more")  # rank 0's own listeners and joins: a follower's results go nowhere
_JOINS = "__joins__"  # sent for ``more``: the follower's sample call follows rank 0's joins
_JOINED = "__joined__"  # ends the work rank 0 ran between two decode steps: the requests that join


def _send(group: Any, name: str, args: Any, kwargs: dict[str, Any]) -> None:
    dist.broadcast_object_list([(name, args, kwargs)], src=0, group=group)


def _receive(group: Any) -> tuple[str, Any, dict[str, Any]]:
    message: list[Any] = [None]
    dist.broadcast_object_list(message, src=0, group=group)
    return message[0]


def _run(backend: TinkerBackend, name: str, args: Any, kwargs: dict[str, Any]) -> None:
    try:
        getattr(backend, name)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - rank 0 answers the client with the same error
        logger.debug("tinker follower: %s raised %s", name, exc)


class LeadJoins:
    """Rank 0's joins of a mirrored sample call: its queue's (``joins``); what they take is mirrored
    (each operation run meanwhile, then the requests that join)."""

    def __init__(self, joins: SampleJoiner, mirror: MirroredBackend) -> None:
        self._joins, self._mirror = joins, mirror

    def waiting(self) -> bool:
        return self._joins.waiting()

    def ran_between(self) -> bool:
        return self._joins.ran_between()

    def take(self) -> list[SampleRequest]:
        requests: list[SampleRequest] = []
        error = None
        self._mirror._between = True
        try:
            requests = list(self._joins.take())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"  # the followers raise it too: all retry together
            raise
        finally:
            self._mirror._between = False
            _send(self._mirror._group, _JOINED, (requests, self._joins.ran_between(), error), {})
        return requests


class FollowedJoins:
    """A follower's joins of a mirrored sample call: it never waits itself (the ranks join when rank
    0's queue waits); at a join it runs the operations rank 0 runs, then takes the same requests."""

    def __init__(self, backend: TinkerBackend, group: Any) -> None:
        self._backend, self._group = backend, group
        self._ran = False

    def waiting(self) -> bool:
        return False

    def ran_between(self) -> bool:
        return self._ran

    def take(self) -> list[SampleRequest]:
        while True:
            name, args, kwargs = _receive(self._group)
            if name != _JOINED:
                _run(self._backend, name, args, kwargs)
                continue
            requests, self._ran, error = args
            if error is not None:
                raise RolloutError(f"rank 0's joins failed: {error}")
            return requests


class MirroredBackend:
    """Rank 0's :class:`~miles_multilora.tinker.backend.TinkerBackend`: an operation
    (:data:`OPERATIONS`) is broadcast to the follower ranks, then run here; anything else is the
    backend's own."""

    def __init__(self, backend: TinkerBackend, group: Any, followers: list[mp.process.BaseProcess]) -> None:
        self._backend = backend
        self._group = group
        self._followers = followers
        self._lock = threading.Lock()
        self._running: int | None = None  # the thread inside an operation
        self._between = False  # a sample call's joins run: operations are mirrored inside it
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name not in OPERATIONS:
            return attr

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            nested = self._running == threading.get_ident()  # the followers are inside the outer one
            if nested and not self._between:
                raise RuntimeError(
                    f"TinkerBackend.{name} called from inside another operation on rank 0: mark it "
                    "@reads if it only reads, else call it on the backend itself"
                )
            sent = {k: v for k, v in kwargs.items() if k not in _CALLBACKS}
            joins = kwargs.get("more")
            if joins is not None:
                if nested:
                    raise RuntimeError(f"TinkerBackend.{name} with joins inside a sample call's joins")
                sent["more"] = _JOINS
            if nested:  # between two decode steps of a sample call: the followers run it there too
                _send(self._group, name, args, sent)
                return attr(*args, **kwargs)
            with self._lock:
                if self._stopped:  # shutting down, the followers gone: rank 0 alone
                    return attr(*args, **kwargs)
                self._check_followers()
                _send(self._group, name, args, sent)
                if joins is not None:
                    kwargs["more"] = LeadJoins(joins, self)
                self._running = threading.get_ident()
                try:
                    return attr(*args, **kwargs)
                finally:
                    self._running = None

        return mirrored

    @property
    def healthy(self) -> bool:
        """Every follower rank is running (and not told to stop)."""
        return not self._stopped and all(p.is_alive() for p in self._followers)

    def _check_followers(self) -> None:
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self._followers) if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"the server's trainer ranks are not all running (rank {dead[0][0]} exited with code "
                f"{dead[0][1]}): restart tinker-serve; saved states and sampler weights are on disk"
            )

    def stop(self, timeout_s: float = 60.0) -> None:
        """Tell the followers to exit and wait for them; later calls run on rank 0 alone."""
        with self._lock:
            if self._stopped:
                return
            if all(p.is_alive() for p in self._followers):
                dist.broadcast_object_list([(_STOP, (), {})], src=0, group=self._group)
            self._stopped = True
        for p in self._followers:
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()


def follow(backend: TinkerBackend, group: Any) -> None:
    """A follower rank's loop: run each operation rank 0 broadcasts, until it says stop."""
    while True:
        name, args, kwargs = _receive(group)
        if name == _STOP:
            return
        if kwargs.get("more") == _JOINS:
            kwargs["more"] = FollowedJoins(backend, group)
        _run(backend, name, args, kwargs)


def rank_offload_dir(cfg: RunConfig, rank: int) -> Path:
    """Where rank ``rank`` parks slots past host memory (each rank its own copies)."""
    return Path(cfg.trainer.output_dir) / "offload" / f"rank{rank}"


def _follower_main(cfg: RunConfig, rank: int, world: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    trainer = TrainerRank(sized_config(cfg, rank, world), rank, world)
    group = dist.new_group(backend="gloo")
    try:
        follow(serve.make_backend(trainer, rank_offload_dir(cfg, rank)), group)
    finally:
        os._exit(0)  # no process-group teardown: the server's process may already be gone


def start_ranks(cfg: RunConfig) -> MirroredBackend:
    """Rank 0 in this process and ranks 1 .. world - 1 as spawned followers, all on this machine,
    each with its rank's wiring; rank 0's backend, mirrored to the followers."""
    world = cfg.trainer.world_size or 1
    gpus = torch.cuda.device_count()
    if gpus and gpus < world:  # (a CPU machine runs the ranks as processes that share its cores)
        raise ConfigError(
            "model.dp",
            f"{world} trainer ranks (model.dp x model.tp) need {world} GPUs of this machine, it has {gpus}",
        )
    master_addr, port = local_rendezvous()
    ctx = mp.get_context("spawn")
    followers = []
    for rank in range(1, world):
        env = rank_env(master_addr, port, rank, world, local_rank=rank)
        p = ctx.Process(
            target=_follower_main, args=(cfg, rank, world, env), name=f"tinker-rank{rank}", daemon=True
        )
        p.start()
        followers.append(p)
    os.environ.update(rank_env(master_addr, port, 0, world, local_rank=0))
    try:
        rank0 = TrainerRank(sized_config(cfg, 0, world), 0, world)
        group = dist.new_group(backend="gloo")
    except BaseException:
        for p in followers:
            p.terminate()
        raise
    logger.info("tinker: %d trainer ranks (model.dp=%s, model.tp=%s)", world, cfg.model.dp, cfg.model.tp)
    return MirroredBackend(serve.make_backend(rank0, rank_offload_dir(cfg, 0)), group, followers)


def start(cfg: RunConfig, port: int | None = None) -> serve.TinkerServer:
    """Serve ``cfg`` on its trainer ranks: one in this process, or ``trainer.world_size`` of them
    (rank 0 here, the followers spawned); returns once the socket accepts connections."""
    if (cfg.trainer.world_size or 1) == 1:
        return serve.start(cfg, port=port)
    return serve.start(cfg, port=port, backend=start_ranks(cfg))


def serve_forever(cfg: RunConfig, console: Any) -> None:
    """``miles-multilora tinker-serve``: serve until SIGINT/SIGTERM."""
    console.print("starting the trainer rank (loading the model) ...")
    server = start(cfg)
    tenants = "one tenant (no key file)" if server.keys.open else f"{len(server.keys.tenants)} tenant key(s)"
    console.print(
        f"[bold]miles_multilora tinker server[/bold] at {server.url}: base_model={server.state.base_model!r}, "
        f"{cfg.lora.num_slots} slots (one per client model), max LoRA rank {cfg.lora.max_rank}, {tenants}; "
        f"clients: tinker.ServiceClient(base_url={server.url!r}, api_key='tml-...')",
        soft_wrap=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0) and server.alive:
        pass
    server.stop()
    console.print("tinker server stopped")
