"""How a trainer rank joins its torch.distributed world: the environment each rank's process
starts with, for the RL door's Ray actors (:mod:`.cluster`) and the Tinker server's ranks
(:mod:`.tinker_ranks`) alike. :func:`~miles_multilora.models.compat.init_process_group` reads it."""

from __future__ import annotations

import os

from miles_multilora.models.compat import free_port


def local_rendezvous() -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT of a world whose ranks all run on this machine (loopback)."""
    return "127.0.0.1", free_port()


def rank_env(
    master_addr: str, port: int, rank: int, world: int, local_rank: int | None = None
) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world``: the rendezvous, its rank, its share of this
    machine's CPU threads and (``local_rank``) which of the GPUs it sees it uses."""
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MILES_TORCH_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
    }
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    return env
