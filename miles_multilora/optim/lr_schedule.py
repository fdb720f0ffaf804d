"""Per-slot learning-rate schedules (from :class:`~miles_multilora.config.adapter.OptimizerSpec`)."""

from __future__ import annotations

import math

from miles_multilora.config.adapter import LR_SCHEDULES, OptimizerSpec
from miles_multilora.errors import SpecError


def learning_rate(spec: OptimizerSpec, step: int, total_steps: int | None = None) -> float:
    """LR of the optimizer step taken after ``step`` earlier steps (``step`` is 0-based).

    Linear warmup from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps`` steps, then
    ``constant`` or ``cosine`` decay to ``min_lr_ratio * lr`` at ``total_steps``.
    """
    if spec.schedule not in LR_SCHEDULES:
        raise SpecError("optimizer.schedule", f"must be one of {LR_SCHEDULES}, got {spec.schedule!r}")
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return spec.lr
    horizon = spec.total_steps if spec.total_steps is not None else total_steps
    if horizon is None:
        raise SpecError(
            "optimizer.total_steps", "the cosine schedule needs total_steps (or the adapter's num_steps)"
        )
    decay_steps = max(1, horizon - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / decay_steps)
    min_lr = spec.min_lr_ratio * spec.lr
    return min_lr + (spec.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
