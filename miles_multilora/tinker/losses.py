"""Tinker's loss functions over a mixed micro-batch: each is a *sum* over the datum's tokens.

Per-position inputs as Tinker sends them (aligned with ``target_tokens``): ``weights`` for
``cross_entropy``; ``logprobs`` (the sampler's, ``q``) and ``advantages`` ``A`` for the RL losses,
with ``r = p / q`` the token's importance ratio:

- ``importance_sampling``: ``-r * A``;
- ``ppo``: ``-min(r * A, clip(r, low, high) * A)`` (``clip_low_threshold`` / ``clip_high_threshold``,
  default 0.8 / 1.2);
- ``cispo``: ``-sg(clip(r, low, high)) * log p * A`` (thresholds default 0 / 4);
- ``dro``: ``-(log p * A - beta / 2 * (log p - log q)^2)`` (``beta``, default 0.05);
- ``gspo`` (GSPO-token): every token's ratio has the value of the datum's sequence ratio
  ``s = exp(mean of log r over the positions sequence_ratio_mask marks)`` and the gradient of its
  own ``log p``; then PPO's clipped objective (thresholds default 0.8 / 1.2). Without a
  ``sequence_ratio_mask`` the marked positions are those with a nonzero advantage (the sampled
  tokens, as the cookbook builds its data);
- ``stable_reinforce``: ``-sg(min(r, 1)) * log p * A`` (this server's stand-in: Tinker does not
  publish its objective, see docs/tinker.md).

Metrics come back per request (the row's ``tag``): ``loss`` (the sum) and ``num_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from miles_multilora.errors import SpecError
from miles_multilora.trainer.primitives import MicroBatch

_RL = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _RL,
    "ppo": _RL,
    "cispo": _RL,
    "dro": _RL,
    "gspo": _RL,
    "stable_reinforce": _RL,
}
# inputs a loss reads when a datum sends them; gspo without its mask takes the sequence ratio over
# the positions with a nonzero advantage (our choice: Tinker documents no default)
OPTIONAL_INPUTS = {"gspo": ("sequence_ratio_mask",)}
# losses whose target_tokens (and their other inputs) may be [N, K]: K targets per position, each
# scored and weighted (top-k distillation: the loss sums weights * logprob over all N * K)
TOPK_LOSSES = ("cross_entropy",)
CONFIG_DEFAULTS = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    # our choices where Tinker's pages give no default: gspo ppo's, dro the beta of their example
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
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
    for key, value in resolved.items():
        if not math.isfinite(value):
            raise SpecError(f"loss_fn_config.{key}", f"must be a finite number, got {value}")
    low, high = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if name in ("ppo", "gspo") and not 0 < low <= 1 <= high:
        raise SpecError("loss_fn_config", f"{name} needs 0 < clip_low_threshold <= 1 <= clip_high_threshold")
    if name == "cispo" and not 0 <= low <= high:
        raise SpecError("loss_fn_config", "cispo needs 0 <= clip_low_threshold <= clip_high_threshold")
    if name == "dro" and resolved["beta"] < 0:
        raise SpecError("loss_fn_config", f"dro needs beta >= 0, got {resolved['beta']:g}")
    return resolved


def input_keys(name: str, inputs: Mapping[str, object]) -> tuple[str, ...]:
    """The inputs of loss ``name`` a datum's ``inputs`` must carry, then the optional ones it sends."""
    return LOSS_INPUTS[name] + tuple(k for k in OPTIONAL_INPUTS.get(name, ()) if k in inputs)


def check_input(name: str, key: str, values: Sequence[float] | np.ndarray, where: str) -> None:
    """A loss's own rule on one (finite, right-sized) datum input: ``gspo``'s mask must mark a token."""
    if name == "gspo" and key == "sequence_ratio_mask" and not np.any(np.asarray(values) != 0):
        raise SpecError(where, "marks no position; mark the sampled tokens that form the sequence ratio")


def per_token_loss(name: str, config: Mapping[str, float], batch: MicroBatch) -> torch.Tensor:
    """``[rows, width]`` loss of each scored token (zero at padding)."""
    lp = batch.logprobs.float()
    if name == "cross_entropy":
        return -batch.values("weights") * lp * batch.mask
    sampled, adv = batch.values("logprobs"), batch.values("advantages")
    ratio = torch.exp(lp - sampled)
    if name == "importance_sampling":
        loss = -ratio * adv
    elif name == "cispo":
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        loss = -torch.clamp(ratio, low, high).detach() * lp * adv
    elif name == "dro":
        loss = -(lp * adv - 0.5 * config["beta"] * (lp - sampled) ** 2)
    elif name == "stable_reinforce":
        loss = -torch.clamp(ratio, max=1.0).detach() * lp * adv
    else:  # ppo, gspo: clipped surrogate; gspo's ratio is the sequence's, with each token's gradient
        if name == "gspo":
            marked = _ratio_positions(batch, adv) * batch.mask
            seq_log_ratio = ((lp.detach() - sampled) * marked).sum(1) / marked.sum(1).clamp(min=1)
            ratio = torch.exp(seq_log_ratio[:, None] + lp - lp.detach())
        clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        loss = -torch.minimum(ratio * adv, clipped * adv)
    return loss * batch.mask


def _ratio_positions(batch: MicroBatch, adv: torch.Tensor) -> torch.Tensor:
    """``[rows, width]`` 0/1: where gspo takes each datum's sequence ratio (its
    ``sequence_ratio_mask``, or where its advantage is nonzero when it sends none)."""
    sent = [("sequence_ratio_mask" in r.values) for r in batch.rows]
    has_mask = torch.tensor(sent, device=adv.device)[:, None]
    return torch.where(has_mask, batch.values("sequence_ratio_mask") != 0, adv != 0).float()


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
