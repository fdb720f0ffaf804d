"""Per-adapter failures inside a training step, agreed on by every rank.

An error that belongs to one adapter (its data, prompt, sampling request, reward, checkpoint)
ends that adapter FAILED with the reason; the step goes on for the others. Ranks of a TP group
must keep training the same adapters, so failures seen on any rank are merged at fixed points of
the step (:meth:`AdapterFailures.agree`), the same collective on every rank.
"""

from __future__ import annotations

import torch.distributed as dist

MAX_REASON_CHARS = 500


def failure_reason(stage: str, exc: BaseException) -> str:
    """A short, user-facing reason: where it failed and the error."""
    text = f"{stage}: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


class AdapterFailures:
    """Adapter name -> reason, for one step of one rank."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self.reasons: dict[str, str] = {}

    def add(self, name: str, stage: str, exc: BaseException) -> None:
        self.reasons.setdefault(name, failure_reason(stage, exc))

    def __contains__(self, name: str) -> bool:
        return name in self.reasons

    def agree(self) -> list[str]:
        """Merge every rank's failures (a collective when world_size > 1); returns the names that
        failed on another rank only, which the caller must drop too."""
        if self.world_size == 1:
            return []
        gathered: list[dict[str, str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, self.reasons)
        new = []
        for rank_reasons in gathered:
            for name, reason in (rank_reasons or {}).items():
                if name not in self.reasons:
                    self.reasons[name] = reason
                    new.append(name)
        return new
