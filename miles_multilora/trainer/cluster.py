"""Ray start-up and the trainer actor group (one Ray actor per trainer rank)."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

import ray

from miles_multilora.config.run import RunConfig
from miles_multilora.models.compat import free_port


def pin_ray_auth_token() -> None:
    """Put the Ray auth token in ``RAY_AUTH_TOKEN`` for this process and its children.

    Token auth is on for a new local cluster, and Ray caches the token a process first used. The
    token is Ray's own default (``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, created if
    missing), so other drivers of this user still attach to a service by name; pinning it in the
    environment keeps every cluster this process starts on the same token.
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if path.is_file() and path.read_text().strip():
        token = path.read_text().strip()
    else:
        token = secrets.token_hex(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
        path.chmod(0o600)
    os.environ["RAY_AUTH_TOKEN"] = token


def start_ray(address: str | None = None, namespace: str = "miles_multilora") -> None:
    """Attach to ``address`` (or ``$RAY_ADDRESS``), else start a local Ray on 127.0.0.1 (idempotent)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        pin_ray_auth_token()
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=True)
        return
    temp_dir = os.environ.get("MILES_RAY_TMPDIR") or tempfile.mkdtemp(prefix="ray_mm_", dir="/tmp")
    ray.init(
        address="local",
        namespace=namespace,
        include_dashboard=False,
        num_cpus=max(2, os.cpu_count() or 2),
        _temp_dir=temp_dir,
        log_to_driver=True,
        configure_logging=False,
    )


def _worker_class() -> Any:
    from miles_multilora.trainer.worker import TrainerWorker

    return ray.remote(num_cpus=0)(TrainerWorker)


def start_trainer_group(cfg: RunConfig) -> list[Any]:
    """``cfg.trainer.world_size`` trainer actors, wired into one torch.distributed world."""
    world = cfg.trainer.world_size
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world)
    actor_cls = _worker_class()
    workers = []
    for rank in range(world):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MILES_TORCH_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
        }
        workers.append(actor_cls.options(runtime_env={"env_vars": env}).remote(cfg, rank, world))
    ray.get([w.__ray_ready__.remote() for w in workers])
    return workers
