"""Policy loss (PPO clip with clip-higher, optional TIS and KL), normalised per slot.

A mixed batch holds sequences of many adapters, each in its own slot. Each slot's loss is
aggregated over its own tokens (``token_mean``) or its own sequences (``seq_mean``) only, and the
batch loss is the sum of the slots' losses, so the gradient an adapter receives never depends on who
else is in the batch. For gradient accumulation over micro-batches pass ``normalizers`` computed once
over the whole step with :func:`slot_normalizers`; the micro-batch losses then sum to the step loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from miles_multilora.algo.config import AGGREGATIONS, AlgoConfig
from miles_multilora.algo.device_metrics import DeviceMetrics
from miles_multilora.host_tensors import tensor_on, to_device


@dataclass
class PolicyLossOutput:
    """``loss``: scalar to backprop (sum of the slots' losses); ``per_slot``: slot -> metrics."""

    loss: torch.Tensor
    per_slot: Mapping[int, dict[str, float]] = field(default_factory=dict)  # DeviceMetrics: read lazily


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1: ``log p - log q``; k2: ``(log p - log q)^2 / 2``; k3: ``q/p - 1 - log(q/p)`` (unbiased, >= 0).
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    if estimator == "k3":
        return torch.exp(-diff) - 1.0 + diff
    raise ValueError(f"unknown kl estimator {estimator!r}; use one of k1, k2, k3")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def slot_normalizers(mask: torch.Tensor, slots: torch.Tensor, aggregation: str) -> dict[int, float]:
    """Each slot's loss denominator: its number of loss tokens (token_mean) or sequences (seq_mean)."""
    _check_aggregation(aggregation)
    per_row = mask.float().sum(dim=1) if aggregation == "token_mean" else torch.ones(mask.shape[0])
    out: dict[int, float] = {}
    for slot, value in zip(slots.detach().cpu().tolist(), per_row.detach().cpu().tolist(), strict=True):
        out[int(slot)] = out.get(int(slot), 0.0) + float(value)
    return out


class SlotGroups(NamedTuple):
    """Rows grouped by slot: the distinct slots (sorted, on the values' device and as ints) and each
    row's index into them."""

    ids: torch.Tensor
    id_list: list[int]
    inverse: torch.Tensor

    @classmethod
    def of(cls, slots: torch.Tensor, device: torch.device) -> SlotGroups:
        """Taken on the host (the slots are host data) and copied to ``device`` without a sync."""
        ids, inverse = torch.unique(slots.detach().cpu(), return_inverse=True)
        return cls(to_device(ids, device), ids.tolist(), to_device(inverse, device))


def aggregate_per_slot(
    values: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    aggregation: str,
    normalizers: Mapping[int, float] | None = None,
    groups: SlotGroups | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregate per-token ``values`` [B, T] into one value per slot.

    Returns ``(unique_slots, per_slot_values)``. token_mean: sum of the slot's masked values over
    its token count; seq_mean: mean over its sequences of each sequence's token mean. ``groups``:
    ``SlotGroups.of(slots, ...)``, when the caller aggregates several values over the same rows.
    """
    _check_aggregation(aggregation)
    mask = mask.to(values.dtype)
    ids, id_list, inverse = groups or SlotGroups.of(slots, values.device)
    row_sum = (values * mask).sum(dim=1)
    row_len = mask.sum(dim=1)
    if aggregation == "token_mean":
        row_value, row_weight = row_sum, row_len
    else:
        row_value, row_weight = row_sum / row_len.clamp(min=1.0), torch.ones_like(row_len)
    numer = torch.zeros(len(id_list), dtype=values.dtype, device=values.device).index_add(
        0, inverse, row_value
    )
    if normalizers is None:
        denom = torch.zeros(len(id_list), dtype=values.dtype, device=values.device).index_add(
            0, inverse, row_weight
        )
    else:
        missing = [i for i in id_list if i not in normalizers]
        if missing:
            raise KeyError(f"normalizers has no entry for slots {missing}")
        denom = tensor_on([float(normalizers[i]) for i in id_list], values.device, values.dtype)
    return ids, numer / denom.clamp(min=1e-8)


def sampler_drift(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    groups: SlotGroups,
    on_policy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """How far the sampler's logprobs are from the trainer's, per slot, over the masked tokens of
    ``log_ratio`` = trainer logprob - sampler logprob (the trainer's first forward of the step, before
    any update: on tokens the current version sampled this is numerics alone, on older ones it adds
    the policy's lag). ``logprob_diff_mean`` / ``logprob_diff_max``: mean and largest absolute
    difference; ``kl_sample_train_v1`` / ``_v2``: the tinker-cookbook's sampler-trainer KL estimates,
    ``mean(sampler - trainer)`` and ``mean((sampler - trainer)^2) / 2``. With ``on_policy`` (1 on the
    tokens the trained version sampled), the same means over those tokens alone: ``on_policy_*``
    (weighted by ``on_policy_tokens``), the numerics without the lag of continuous rollout."""
    diff = -log_ratio.float()
    absolute = diff.abs()
    means = (
        ("logprob_diff_mean", absolute),
        ("kl_sample_train_v1", diff),
        ("kl_sample_train_v2", 0.5 * diff**2),
    )
    out = {
        name: aggregate_per_slot(values, mask, slots, "token_mean", groups=groups)[1]
        for name, values in means
    }
    masked = torch.where(mask > 0, absolute, torch.zeros_like(absolute)).amax(dim=1)
    out["logprob_diff_max"] = torch.zeros(len(groups.id_list), device=diff.device).scatter_reduce(
        0, groups.inverse, masked, reduce="amax", include_self=True
    )
    if on_policy is not None:
        fresh = mask * on_policy.to(mask)
        for name, values in means:
            out[f"on_policy_{name}"] = aggregate_per_slot(values, fresh, slots, "token_mean", groups=groups)[
                1
            ]
        out["on_policy_tokens"] = aggregate_per_slot(
            fresh, fresh, slots, "token_mean", dict.fromkeys(groups.id_list, 1.0), groups
        )[1]
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    config: AlgoConfig | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    normalizers: Mapping[int, float] | None = None,
    on_policy: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped policy-gradient loss summed over slots, each normalised over its own tokens.

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` (and ``ref_logprobs``, ``rollout_logprobs``)
    are ``[B, T]``; ``advantages`` is ``[B]`` or ``[B, T]``; ``slots`` is ``[B]`` (each sequence's
    slot, or any integer id that groups sequences). ``old_logprobs`` are the logprobs the importance ratio is taken
    against (the rollout's). With ``config.tis_cap`` and ``rollout_logprobs`` given, each token is
    weighted by ``min(exp(old - rollout), tis_cap)`` (truncated importance sampling for a rollout
    engine whose logprobs differ from the trainer's). With ``config.dual_clip_c`` a token of negative
    advantage ``A`` contributes at most ``-A * dual_clip_c`` (dual-clip PPO). ``ref_logprobs`` (base model, slot -1) adds
    ``kl_coef * KL``. ``on_policy`` (``[B, T]``, 1 on tokens the trained version sampled) adds the
    sampler drift over those tokens alone (:func:`sampler_drift`).
    """
    cfg = (config or AlgoConfig()).resolved()
    assert cfg.eps_high is not None and cfg.aggregation is not None
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [batch, seq] shape"
        )
    if slots.shape != (logprobs.shape[0],):
        raise ValueError(f"slots must be [batch]={logprobs.shape[0]}, got {tuple(slots.shape)}")
    logprobs = logprobs.float()
    adv = advantages.float().to(logprobs.device)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    mask_f = mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs.float().detach()
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = (pg_clipped > pg_unclipped).to(logprobs.dtype)
    dual_clipped = torch.zeros_like(pg)
    if cfg.dual_clip_c is not None:  # a negative advantage's term is bounded: no gradient past the bound
        bound = -adv * cfg.dual_clip_c
        over = (adv < 0) & (pg > bound)
        dual_clipped = over.to(logprobs.dtype)
        pg = torch.where(over, bound.expand_as(pg), pg)

    tis_clipped = torch.zeros_like(pg)
    if cfg.tis_cap is not None and rollout_logprobs is not None:
        weight = torch.exp(old_logprobs.float() - rollout_logprobs.float()).detach()
        tis_clipped = (weight > cfg.tis_cap).to(pg.dtype)
        pg = pg * weight.clamp(max=cfg.tis_cap)

    total = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.float().detach(), cfg.kl_estimator)
        if cfg.kl_coef > 0:
            total = total + cfg.kl_coef * kl

    groups = SlotGroups.of(slots, logprobs.device)  # once for every aggregate below
    _, loss_per_slot = aggregate_per_slot(total, mask_f, slots, cfg.aggregation, normalizers, groups)
    loss = loss_per_slot.sum()

    with torch.no_grad():
        columns = {"loss": loss_per_slot.detach()}
        columns["pg_loss"] = aggregate_per_slot(
            pg.detach(), mask_f, slots, cfg.aggregation, normalizers, groups
        )[1]
        for name, values in (
            ("clip_frac", clipped),
            ("dual_clip_frac", dual_clipped),
            ("ratio_mean", ratio.detach()),
            ("tis_clip_frac", tis_clipped),
        ):
            columns[name] = aggregate_per_slot(values, mask_f, slots, "token_mean", groups=groups)[1]
        if kl is not None:
            columns["kl"] = aggregate_per_slot(kl.detach(), mask_f, slots, "token_mean", groups=groups)[1]
        columns.update(sampler_drift(log_ratio.detach(), mask_f, slots, groups, on_policy))
        columns["num_tokens"] = aggregate_per_slot(
            mask_f, mask_f, slots, "token_mean", dict.fromkeys(groups.id_list, 1.0), groups
        )[1]
        names = list(columns)
        table = torch.stack([columns[n].float() for n in names], dim=1)  # read when looked at
    return PolicyLossOutput(loss=loss, per_slot=DeviceMetrics(list(groups.id_list), names, table))
