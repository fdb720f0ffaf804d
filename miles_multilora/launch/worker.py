"""One trainer rank as a Ray actor: the rank, the RL recipe on it, and where it runs."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from miles_multilora.config.run import RunConfig
from miles_multilora.controller.snapshot import AdapterResult, Snapshot, StepReport
from miles_multilora.models import compat
from miles_multilora.rl import RLStep


class TrainerWorker:
    """What the driver calls on each rank (``ray.remote`` of this class, one actor per rank)."""

    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1) -> None:
        self.rl = RLStep.build(cfg, rank, world_size)

    def step(self, snapshot: Snapshot) -> StepReport:
        return self.rl.step(snapshot)

    def checkpoint(self, name: str) -> AdapterResult:
        """A checkpoint of resident ``name`` at its current step (a collective: every rank calls it)."""
        path = self.rl.save_checkpoint(name)
        return AdapterResult(trained=False, step=self.rl.version(name), checkpoint=path)

    def sized_settings(self) -> dict[str, Any]:
        """The settings ``lora.num_slots=auto`` resolved on this rank (``trainer/auto_slots.py``): the
        slot count its warm-up sized and the probe's recompute and token budget, which a trainer
        group started again must reuse."""
        cfg = self.rl.rank.cfg
        return {
            "num_slots": cfg.lora.num_slots,
            "recompute": cfg.trainer.recompute,
            "max_tokens_per_micro_batch": cfg.trainer.max_tokens_per_micro_batch,
            "memory_check": cfg.trainer.memory_check,
        }

    def placement(self) -> dict[str, Any]:
        """Where this rank runs: its DP, TP and EP ranks, host and device (the GPU's UUID on CUDA)."""
        rank = self.rl.rank
        info: dict[str, Any] = {
            "rank": rank.global_rank,
            "dp_rank": rank.layout.dp_rank,
            "tp_rank": rank.layout.tp_rank,
            "ep_rank": rank.layout.ep_rank,
            "ep_size": rank.layout.ep_size,
            "host": socket.gethostname(),
            "device": str(compat.default_device()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        if not compat.is_cpu():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            info["gpu"] = f"{props.name} {getattr(props, 'uuid', '')}".strip()
        return info
