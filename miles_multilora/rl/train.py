"""The train phase of the RL recipe: GRPO/DAPO rows from the scored groups, one mixed-slot
forward/backward with the policy loss, one optimizer step of every slot that had rows.

Each adapter's loss is normalised over the whole step (its tokens or sequences across every
micro-batch and DP rank), so micro-batching and data parallelism change speed, never the update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from miles_multilora.algo import AlgoConfig, group_advantages, policy_loss, slot_normalizers
from miles_multilora.rl.adapters import Residents
from miles_multilora.rl.rollout import Group
from miles_multilora.trainer.primitives import LossFn, MicroBatch, ScoredRow, finish_metrics


@dataclass
class Trained:
    """The train phase's outcome: per adapter, its loss metrics and optimizer step (``skipped``:
    it did not move), and the tokens of the step's rows (all of them, and this rank's share)."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    tokens: int = 0
    rank_tokens: int = 0

    def moved(self, name: str) -> bool:
        """Whether ``name``'s weights moved (it had rows and its step was not vetoed)."""
        return name in self.metrics and not self.metrics[name].get("skipped")


def policy_rows(
    groups: list[Group], algo: AlgoConfig, versions: Mapping[str, int] | None = None
) -> list[ScoredRow]:
    """One row per non-empty sample of each rewarded group: its response positions scored at the
    temperature its result was sampled at, with the rollout's logprobs and the group's advantage. A
    group's rows share a ``group`` id, so they train on one DP rank. With ``versions`` (each
    adapter's weight version now), a row also marks its tokens sampled by that version
    (``on_policy``: 1, else 0), for the sampler drift of on-policy tokens alone."""
    rows: list[ScoredRow] = []
    group_id = 0
    for g in groups:
        if not g.rewards:
            continue
        adv = group_advantages(
            g.rewards, [0] * len(g.rewards), std_normalize=algo.std_normalize, eps=algo.adv_eps
        )
        mine = []
        for r, a in zip(g.results, adv.tolist(), strict=True):
            if not r.output_ids:
                continue
            tokens = list(r.prompt_ids) + list(r.output_ids)
            n = len(r.output_ids)
            values = {"old_logprobs": list(r.logprobs[:n]), "advantages": [a] * n}
            if versions is not None:
                now = versions[r.adapter]
                values["on_policy"] = [float(v == now) for v in r.versions()[:n]]
            positions = list(range(len(r.prompt_ids) - 1, len(tokens) - 1))
            row = ScoredRow(
                r.slot, tokens, positions, temperature=r.temperature, values=values, group=group_id
            )
            mine.append(row)
        if mine:
            rows.extend(mine)
            group_id += 1
    return rows


def rl_loss(algo: AlgoConfig, normalizers: Mapping[int, float]) -> LossFn:
    """The GRPO/DAPO policy loss of a micro-batch, normalised per slot over the whole step."""

    def loss(batch: MicroBatch) -> tuple[torch.Tensor, dict[int, dict[str, float]]]:
        out = policy_loss(
            batch.logprobs,
            batch.values("old_logprobs"),
            batch.values("advantages"),
            batch.mask,
            batch.slots,
            config=algo,
            ref_logprobs=batch.reference,
            normalizers=normalizers,
            on_policy=batch.values("on_policy") if any("on_policy" in r.values for r in batch.rows) else None,
        )
        return out.loss, out.per_slot

    return loss


def step_normalizers(rows: list[ScoredRow], algo: AlgoConfig) -> dict[int, float]:
    """Each slot's loss denominator over all of the step's rows."""
    mask = torch.zeros(len(rows), max(r.width for r in rows))
    for i, r in enumerate(rows):
        mask[i, : r.width] = 1
    return slot_normalizers(mask, torch.tensor([r.slot for r in rows]), algo.aggregation)


def train(groups: list[Group], residents: Residents, algo: AlgoConfig) -> Trained:
    """One mixed batch of every adapter's rows, then one optimizer step of each slot in it (its new
    version published by the rank)."""
    rows = policy_rows(groups, algo, {name: residents.version(name) for name in residents})
    if not rows:
        return Trained()
    rank = residents.rank
    result = rank.forward_backward(
        rows, rl_loss(algo, step_normalizers(rows, algo)), reference=algo.kl_coef > 0, return_logprobs=False
    )
    stats = rank.optim_step(sorted({r.slot for r in rows}))
    by_slot = {residents[name].slot: name for name in residents}
    trained = Trained(tokens=sum(len(r.tokens) for r in rows), rank_tokens=result.local_tokens)
    for slot, s in stats.items():
        metrics = finish_metrics(result.per_slot.get(slot, {}))
        metrics.update(grad_norm=s.grad_norm, lr=s.lr, skipped=float(s.skipped))
        trained.metrics[by_slot[slot]] = metrics
    return trained
