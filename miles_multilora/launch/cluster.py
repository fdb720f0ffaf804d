"""Ray start-up and the trainer actor group (one Ray actor per trainer rank)."""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

import ray

from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError
from miles_multilora.launch.wiring import local_rendezvous, rank_env
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
    # every worker hides the known third-party notices, as the driver does (third_party_noise)
    runtime_env = {"worker_process_setup_hook": "miles_multilora.third_party_noise.install"}
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=True, runtime_env=runtime_env)
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
        runtime_env=runtime_env,
    )


PLACEMENT_TIMEOUT_S = float(os.environ.get("MILES_PLACEMENT_TIMEOUT_S", 120))


def _worker_class() -> Any:
    from miles_multilora.launch.worker import TrainerWorker

    return ray.remote(TrainerWorker)


def cluster_gpus() -> int:
    """GPUs the Ray cluster offers (0 on a CPU cluster: trainer ranks then run on CPU)."""
    return int(ray.cluster_resources().get("GPU", 0))


def node_group_size(tp: int, pp: int, ep: int) -> int:
    """How many consecutive global ranks must share a node: a TP (x PP) group, and with expert
    parallelism an EP group too (Megatron's EP groups are ``ep`` consecutive ranks, experts whole on
    each rank; their tokens cross the group at every MoE layer), so the least common multiple."""
    return math.lcm(tp * pp, ep)


def rank_bundles(world: int, group_size: int) -> list[tuple[int, int]]:
    """``(placement group, bundle)`` of each global rank: one group per ``group_size`` consecutive
    ranks (:func:`node_group_size`), in megatron's rank order (tensor-parallel rank fastest), so each
    TP group and each EP group lands on one node."""
    return [(rank // group_size, rank % group_size) for rank in range(world)]


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """Rank 0's node address and a free port on it (MASTER_ADDR / MASTER_PORT of the world)."""
    return ray.util.get_node_ip_address(), free_port()


def _placement_groups(world: int, group_size: int, gpus: int, key: str = "model.tp") -> list[Any]:
    """One STRICT_PACK placement group of ``group_size`` single-GPU bundles per group of ranks that
    must share a node (:func:`node_group_size`); ``key``: the setting that sized the groups."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if gpus < world:
        raise ConfigError(
            "trainer.world_size",
            f"{world} trainer ranks need {world} GPUs (one each) but the Ray cluster has {gpus}; "
            "lower model.dp or model.tp, or add GPUs",
        )
    groups = [
        placement_group([{"GPU": 1, "CPU": 1}] * group_size, strategy="STRICT_PACK")
        for _ in range(world // group_size)
    ]
    try:
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for g in groups:
            remove_placement_group(g)
        raise ConfigError(
            key,
            f"could not place {len(groups)} groups of {group_size} GPUs (+1 CPU each), each on one "
            f"node, within {PLACEMENT_TIMEOUT_S:.0f}s: a tensor-parallel group (and an expert-parallel "
            "one) must fit on one node (check `ray status`: free GPUs per node)",
        ) from None
    return groups


def start_trainer_group(cfg: RunConfig, worker: type | None = None) -> list[Any]:
    """``cfg.trainer.world_size`` trainer actors, wired into one torch.distributed world: each a
    ``worker(cfg, rank, world)`` (default :class:`~miles_multilora.launch.worker.TrainerWorker`,
    the RL recipe on a rank).

    On a Ray cluster with GPUs each rank asks for one GPU inside a placement group that keeps its
    TP group (and its EP group, ``model.ep`` > 1) on one node, and uses the GPU Ray assigns it;
    MASTER_ADDR is rank 0's node. On a CPU cluster the actors share the local CPUs.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = cfg.trainer.world_size
    assert world is not None  # filled in by the config's validation
    m = cfg.model
    group_size = node_group_size(m.tp, m.pp, m.ep)
    gpus = cluster_gpus()
    actor_cls = ray.remote(worker) if worker is not None else _worker_class()
    options: list[dict[str, Any]] = [{"num_cpus": 0} for _ in range(world)]
    master_addr, port = local_rendezvous()
    if gpus:
        groups = _placement_groups(
            world, group_size, gpus, "model.ep" if group_size > m.tp * m.pp else "model.tp"
        )
        for rank, (group, bundle) in enumerate(rank_bundles(world, group_size)):
            strategy = PlacementGroupSchedulingStrategy(groups[group], placement_group_bundle_index=bundle)
            options[rank] = {"num_gpus": 1, "num_cpus": 1, "scheduling_strategy": strategy}
        first = PlacementGroupSchedulingStrategy(groups[0], placement_group_bundle_index=0)
        master_addr, port = ray.get(_rendezvous.options(scheduling_strategy=first).remote())
    workers = []
    for rank in range(world):
        # Ray shows each actor only the GPU it assigned: its LOCAL_RANK is 0
        env = rank_env(master_addr, port, rank, world, local_rank=0 if gpus else None)
        workers.append(
            actor_cls.options(runtime_env={"env_vars": env}, **options[rank]).remote(cfg, rank, world)
        )
    ray.get([w.__ray_ready__.remote() for w in workers])
    return workers


def placement_lines(workers: list[Any]) -> list[str]:
    """One line per trainer rank: its DP/TP (and EP) ranks, host and device."""
    lines = []
    for p in ray.get([w.placement.remote() for w in workers]):
        where = p.get("gpu") or p["device"]
        ep = f", ep {p['ep_rank']}" if p.get("ep_size", 1) > 1 else ""
        lines.append(f"rank {p['rank']} (dp {p['dp_rank']}, tp {p['tp_rank']}{ep}): {p['host']} {where}")
    return lines
