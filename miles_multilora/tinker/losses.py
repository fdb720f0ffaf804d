"""Tinker's loss functions over a mixed micro-batch: each is a *sum* over the datum's tokens.

Per-position inputs as Tinker sends them (aligned with ``target_tokens``): ``weights`` for
``cross_entropy``; ``logprobs`` (the sampler's) and ``advantages`` for ``importance_sampling``,
``ppo`` (clip thresholds ``clip_low_threshold`` / ``clip_high_threshold``, default 0.8 / 1.2) and
``cispo`` (the ratio clipped to the thresholds, default 0 / 4, is a detached coefficient of the
logprob: ``-sg(clip(ratio)) * logprob * advantage``).
Metrics come back per request (the row's ``tag``): ``loss`` (the sum) and ``num_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles_multilora.errors import SpecError
from miles_multilora.trainer.primitives import MicroBatch

LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
CONFIG_DEFAULTS = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
}


def check_loss(name: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's resolved config; a clear error for an unknown loss or config key."""
    if name not in LOSS_INPUTS:
        raise SpecError("loss_fn", f"unknown loss {name!r}; supported: {', '.join(LOSS_INPUTS)}")
    config = dict(config or {})
    allowed = CONFIG_DEFAULTS.get(name, {})
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise SpecError(
            "loss_fn_config", f"{name} takes no {', '.join(unknown)} (allowed: {sorted(allowed) or 'none'})"
        )
    resolved = {**allowed, **{k: float(v) for k, v in config.items()}}
    if name == "ppo" and not 0 < resolved["clip_low_threshold"] <= 1 <= resolved["clip_high_threshold"]:
        raise SpecError("loss_fn_config", "ppo needs 0 < clip_low_threshold <= 1 <= clip_high_threshold")
    if name == "cispo" and not 0 <= resolved["clip_low_threshold"] <= resolved["clip_high_threshold"]:
        raise SpecError("loss_fn_config", "cispo needs 0 <= clip_low_threshold <= clip_high_threshold")
    return resolved


def per_token_loss(name: str, config: Mapping[str, float], batch: MicroBatch) -> torch.Tensor:
    """``[rows, width]`` loss of each scored token (zero at padding)."""
    lp = batch.logprobs.float()
    if name == "cross_entropy":
        loss = -batch.values("weights") * lp
    else:
        ratio = torch.exp(lp - batch.values("logprobs"))
        adv = batch.values("advantages")
        if name == "importance_sampling":
            loss = -ratio * adv
        elif name == "cispo":
            low, high = config["clip_low_threshold"], config["clip_high_threshold"]
            loss = -torch.clamp(ratio, low, high).detach() * lp * adv
        else:
            clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
            loss = -torch.minimum(ratio * adv, clipped * adv)
    return loss * batch.mask


def tinker_loss(losses: Mapping[int, tuple[str, Mapping[str, float]]]):  # noqa: ANN201 - a LossFn
    """A loss function for a micro-batch mixing requests: row tag -> (loss name, config)."""

    def loss(batch: MicroBatch) -> tuple[torch.Tensor, dict[int, dict[str, float]]]:
        tags = [r.tag for r in batch.rows]
        total = batch.logprobs.new_zeros(())
        metrics: dict[int, dict[str, float]] = {}
        for tag in dict.fromkeys(tags):
            index = torch.tensor([i for i, t in enumerate(tags) if t == tag], device=batch.mask.device)
            sub = MicroBatch(
                [batch.rows[i] for i in index.tolist()], batch.logprobs[index], batch.mask[index]
            )
            name, config = losses[tag]
            value = per_token_loss(name, config, sub).sum()
            total = total + value
            metrics[tag] = {"loss": float(value.detach()), "num_tokens": float(sub.mask.sum())}
        return total, metrics

    return loss
