"""Per-adapter failures inside a training step, agreed on by every rank.

An error that belongs to one adapter (its data, prompt, sampling request, reward, checkpoint)
ends that adapter FAILED with the reason; the step goes on for the others. Ranks of a TP group
must keep training the same adapters, so failures seen on any rank are merged at fixed points of
the step (:meth:`AdapterFailures.agree`), the same collective on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_REASON_CHARS = 500


def failure_reason(stage: str, exc: BaseException) -> str:
    """A short, user-facing reason: where it failed and the error."""
    text = f"{stage}: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


class AdapterFailures:
    """Adapter name -> reason, for one step of one rank. ``gather`` is the rank's all-gather
    (:meth:`~miles_multilora.trainer.rank.TrainerRank.gather`; none: a single rank)."""

    def __init__(self, gather: Callable[[Any], list[Any]] | None = None) -> None:
        self._gather = gather
        self.reasons: dict[str, str] = {}

    def add(self, name: str, stage: str, exc: BaseException) -> None:
        self.reasons.setdefault(name, failure_reason(stage, exc))

    def fail(self, name: str, reason: str) -> None:
        """``name`` fails with ``reason`` (its first reason in this step is kept)."""
        self.reasons.setdefault(name, reason)

    def __contains__(self, name: str) -> bool:
        return name in self.reasons

    def agree(self) -> list[str]:
        """Merge every rank's failures (a collective across ranks); returns the names that failed on
        another rank only, which the caller must drop too."""
        if self._gather is None:
            return []
        new = []
        for rank_reasons in self._gather(dict(self.reasons)):
            for name, reason in (rank_reasons or {}).items():
                if name not in self.reasons:
                    self.reasons[name] = reason
                    new.append(name)
        return new


def first_error(errors: list[str | None]) -> str | None:
    """The first of the ranks' errors (None when every rank succeeded)."""
    return next((e for e in errors if e is not None), None)
