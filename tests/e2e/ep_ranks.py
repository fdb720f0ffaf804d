"""A trainer rank as a Ray actor that trains without sampling (``test_ep_placement``): placed and
wired by the same ``launch.cluster.start_trainer_group`` as the RL door's ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.config.run import RunConfig
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank


def _loss(batch):  # noqa: ANN001, ANN202 - a LossFn: the rows' summed token NLL
    nll = -(batch.logprobs * batch.mask)
    num = float(batch.mask.sum())
    return nll.sum(), {0: {"num_tokens": num, "loss": float(nll.sum().detach())}}


class TrainOnlyRank:
    """One rank: :class:`TrainerRank` and what the test asks of it."""

    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1) -> None:
        self.rank = TrainerRank(cfg, rank, world_size)

    def placement(self) -> dict[str, Any]:
        layout = self.rank.layout
        return {
            "rank": self.rank.global_rank, "dp_rank": layout.dp_rank, "tp_rank": layout.tp_rank,
            "ep_rank": layout.ep_rank, "ep_size": layout.ep_size, "expert_dp_rank": layout.expert_dp_rank,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }  # fmt: skip

    def train(self, out: str) -> dict[str, Any]:
        """Two forward_backward + optim_step rounds of one slot over three rows (an odd number: the
        DP ranks run different numbers of micro-batches), then its PEFT export into ``out``."""
        rank = self.rank
        rank.open_slot(0, 4, 8.0, 0, OptimizerSpec(lr=5e-2), "a")
        rows = [ScoredRow(0, list(range(3 + i, 15 + i)), list(range(11)), group=i) for i in range(3)]
        before = rank.score(rows)
        losses, norms = [], []
        for _ in range(2):
            losses.append(rank.forward_backward(rows, _loss).per_slot[0]["loss"])
            norms.append(rank.optim_step([0])[0].grad_norm)
        after = rank.score(rows)
        rank.export_peft(0, Path(out))
        moved = max(
            abs(a - b)
            for x, y in zip(before, after, strict=True)
            for a, b in zip(x.logprobs, y.logprobs, strict=True)
        )
        return {
            "losses": losses,
            "norms": norms,
            "version": rank.version(0),
            "moved": moved,
        }
