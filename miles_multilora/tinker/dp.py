"""The Tinker server over several trainer ranks (``trainer.world_size`` > 1: DP, and TP within it).

Rank 0 is the server's process: its HTTP app, queue and backend. Every other rank is a process of
its own that builds the same trainer rank and backend and then only *follows*: each backend call
that changes state (a model created, loaded, trained, stepped, parked, sampled ...) is broadcast
from rank 0 before rank 0 runs it, and every follower runs the same call on its own backend. The
trainer rank's operations are SPMD already (:class:`~miles_multilora.trainer.rank.TrainerRank`):
under DP a forward/backward trains each rank's share of the rows and sums the slots' gradients in
``optim_step``, and a sampling call generates each rank's share of the requests and gathers the
results, so clients' work is spread over the ranks while every rank's slots stay identical.
Reads (a model's slot, the held models) stay on rank 0. Files are written by the ranks the
trainer rank names as writers; each rank parks its slots under its own offload directory.

The calls reach rank 0's backend from one thread (the queue's worker; at shutdown, the stopping
thread after the queue has closed), and a lock keeps broadcast and run together, so every rank
runs them in the same order. A follower whose call raises goes on: rank 0 runs the same
deterministic code and answers the client with the same error.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from miles_multilora.config.run import RunConfig

logger = logging.getLogger(__name__)

# the backend's calls that change state (and run the trainer rank's collectives): every rank runs them
MIRRORED = frozenset({
    "create_model", "unload_model", "load_copy", "drop_copy", "save_sampler_weights", "forward_backward",
    "optim_step", "sample", "sample_many", "score_prompt", "save_state", "export_peft", "load_state",
})  # fmt: skip
_STOP = "__stop__"
_CALLBACKS = ("on_done", "more")  # rank 0's own listeners and joins: a follower's results go nowhere


class MirroredBackend:
    """Rank 0's :class:`~miles_multilora.tinker.backend.TinkerBackend`: a call of :data:`MIRRORED` is
    broadcast to the follower ranks, then run here; anything else is the backend's own."""

    def __init__(self, backend: Any, group: Any, followers: list[mp.process.BaseProcess]) -> None:
        self._backend = backend
        self._group = group
        self._followers = followers
        self._lock = threading.Lock()
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name not in MIRRORED:
            return attr

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            sent = {k: v for k, v in kwargs.items() if k not in _CALLBACKS}
            with self._lock:
                if self._stopped:  # shutting down, the followers gone: rank 0 alone
                    return attr(*args, **kwargs)
                self._check_followers()
                dist.broadcast_object_list([(name, args, sent)], src=0, group=self._group)
                return attr(*args, **kwargs)

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


def follow(backend: Any, group: Any) -> None:
    """A follower rank's loop: run each call rank 0 broadcasts, until it says stop."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        name, args, kwargs = message[0]
        if name == _STOP:
            return
        try:
            getattr(backend, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rank 0 answers the client with the same error
            logger.debug("tinker follower: %s raised %s", name, exc)


def rank_offload_dir(cfg: RunConfig, rank: int) -> Path:
    """Where rank ``rank`` parks slots past host memory (each rank its own copies)."""
    return Path(cfg.trainer.output_dir) / "offload" / f"rank{rank}"


def _follower_main(
    cfg: RunConfig, rank: int, world: int, env: dict[str, str], make_backend: Callable[..., Any]
) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    from miles_multilora.trainer.auto_slots import sized_config
    from miles_multilora.trainer.rank import TrainerRank

    trainer = TrainerRank(sized_config(cfg, rank, world), rank, world)
    group = dist.new_group(backend="gloo")
    try:
        follow(make_backend(trainer, rank_offload_dir(cfg, rank)), group)
    finally:
        os._exit(0)  # no process-group teardown: the server's process may already be gone


def start_followers(
    cfg: RunConfig, world: int, env: dict[str, str], make_backend: Callable[..., Any]
) -> list[mp.process.BaseProcess]:
    """Ranks 1 .. world - 1 as spawned processes (they join rank 0's world and build their ranks)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(
            target=_follower_main,
            args=(cfg, rank, world, env, make_backend),
            name=f"tinker-rank{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs
