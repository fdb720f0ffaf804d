"""GRPO group advantages: each sample's reward relative to the other samples of its prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Mean-centred (and optionally std-normalised) rewards within each group.

    ``rewards`` and ``group_ids`` are 1-D and aligned; groups may have different sizes (adapters
    sample different ``n_samples_per_prompt``). The std is the unbiased sample std; a group of
    one sample gets advantage 0. Returns float32 advantages shaped like ``rewards``.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    g = torch.as_tensor(group_ids, dtype=torch.long).flatten()
    if r.shape != g.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and group_ids {tuple(g.shape)} must have the same length")
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    _, inverse = torch.unique(g, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count
    centred = r - mean[inverse]
    if std_normalize:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred**2)
        var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
        denom = var.sqrt()[inverse] + eps
        centred = torch.where(denom > 0, centred / denom.clamp(min=1e-30), torch.zeros_like(centred))
    return centred.to(torch.float32)


def grpo_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for rewards shaped ``[num_groups, samples_per_group]`` (same shape back)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, samples_per_group], got shape {tuple(r.shape)}")
    ids = torch.arange(r.shape[0]).repeat_interleave(r.shape[1])
    return group_advantages(r.flatten(), ids, std_normalize=std_normalize, eps=eps).view(r.shape)
