"""Which RUNNING adapters hold the resident slots this step, when more run than there are slots.

With ``controller.max_running`` above ``lora.num_slots`` an adapter is RUNNING as soon as it is
admitted, and the slots take turns: the trainer parks an adapter that leaves its slot (its whole
state off the GPU, :mod:`~miles_multilora.trainer.offload`) and restores it when it comes back.
The turn rule is a weighted fair share by trained tokens: an adapter that has held a slot for fewer
than ``min_residency_steps`` steps keeps it (no thrashing), a DRAINING adapter keeps or gets one
(it must checkpoint), and the other slots go first to the highest ``priority`` (at most the
tenant's ``max_priority``, an operator setting), then to the adapters that have trained the fewest
tokens per unit of their ``share`` (registration order breaks ties). A tenant over its ``tokens_per_hour`` quota (:mod:`~miles_multilora.controller.quotas`)
is no candidate at all until its window allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_multilora.controller.quotas import TenantQuotas
from miles_multilora.errors import ConfigError


@dataclass(frozen=True)
class ResidencyPolicy:
    """``max_running``: adapters RUNNING at once (None: one per slot, no turns);
    ``min_residency_steps``: steps an adapter keeps a slot before it may be parked;
    ``quotas``: per-tenant limits (a ``tokens_per_hour`` limit makes adapters take turns even
    within the slots, so that one over it can be parked)."""

    max_running: int | None = None
    min_residency_steps: int = 4
    quotas: TenantQuotas = field(default_factory=TenantQuotas)

    def __post_init__(self) -> None:
        if self.max_running is not None and self.max_running < 1:
            raise ConfigError(
                "controller.max_running", f"must be >= 1 (0: lora.num_slots), got {self.max_running}"
            )
        if self.min_residency_steps < 1:
            raise ConfigError(
                "controller.min_residency_steps", f"must be >= 1, got {self.min_residency_steps}"
            )

    def takes_turns(self, num_slots: int) -> bool:
        return (self.max_running is not None and self.max_running > num_slots) or self.quotas.limits_tokens


@dataclass(frozen=True)
class Candidate:
    """One RUNNING or DRAINING adapter as the turn rule sees it."""

    run_id: str
    seq: int
    served_tokens: float
    resident: bool
    resident_steps: int
    draining: bool
    priority: int = 0
    share: float = 1.0


def choose_residents(candidates: Sequence[Candidate], num_slots: int, min_residency_steps: int) -> list[str]:
    """The run ids that hold the slots next, at most ``num_slots``: the ones that must stay or come
    (DRAINING, or resident for fewer than ``min_residency_steps`` steps), then by priority, then
    the least served per unit of share."""
    must = [c for c in candidates if c.draining or (c.resident and c.resident_steps < min_residency_steps)]
    must.sort(key=lambda c: (not c.resident, c.seq))  # residents first: they hold their slots already
    chosen = must[:num_slots]
    taken = {c.run_id for c in chosen}
    rest = sorted(
        (c for c in candidates if c.run_id not in taken),
        key=lambda c: (-c.priority, c.served_tokens / c.share, c.seq),
    )
    chosen += rest[: num_slots - len(chosen)]
    return [c.run_id for c in chosen]
