"""One bad request never fails a shared engine call: the call is split and retried without it.

Many adapters' (or Tinker clients') groups of requests share one engine call. The doors check
every value (:mod:`miles_multilora.config.adapter`, :mod:`miles_multilora.tinker.params`) and the
engine checks each request before a batch runs (:meth:`~.engine.RolloutEngine.check_request`);
should a value slip past both and fail the call anyway, :func:`generate_isolated` generates the
groups again in halves until each failing group is alone. That group's outcome is its error, the
others' their samples. When every group fails, the engine itself is at fault: the first error is
raised, as before (the trainer group is replaced, no adapter is blamed). With expert parallelism
an engine call is a collective of the EP ranks: :func:`checked_once` checks each group first and
makes one call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from miles_multilora.rollout.engine import RolloutError
from miles_multilora.rollout.types import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

Groups = Sequence[Sequence[GenerationRequest]]
GroupOutcome = list[GenerationResult] | RolloutError
"""A group's samples, or the error that failed it alone."""


def group_error(exc: Exception) -> RolloutError:
    """The error a group failed with, as a plain :class:`RolloutError` (it crosses ranks pickled;
    the original is its ``__cause__`` on this rank)."""
    if type(exc) is RolloutError:
        return exc
    error = RolloutError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def split_failures(
    groups: Groups, generate: Callable[[list[Sequence[GenerationRequest]]], list[list[GenerationResult]]]
) -> list[GroupOutcome]:
    """``generate(groups)``; when it raises, the halves again, down to single groups, whose error is
    their outcome. Never raises an :class:`Exception` (every group's outcome may be an error)."""
    part = list(groups)
    if not part:
        return []
    try:
        return list(generate(part))
    except Exception as exc:  # noqa: BLE001 - blamed on the group that fails alone
        if len(part) == 1:
            return [group_error(exc)]
        log.warning("an engine call of %d groups failed (%s); retrying it in halves", len(part), exc)
    mid = len(part) // 2
    return split_failures(part[:mid], generate) + split_failures(part[mid:], generate)


def checked_once(
    groups: Groups,
    generate: Callable[[list[Sequence[GenerationRequest]]], list[list[GenerationResult]]],
    check: Callable[[GenerationRequest, int], None],
) -> list[GroupOutcome]:
    """``generate`` once over the groups whose requests pass ``check`` (the others' outcome: their
    error), called even when no group is left. For an expert-parallel engine, whose every call is a
    collective the other EP ranks join: a failed call is not split and retried on this rank alone
    (its peers would not follow); its error is the outcome of every group it carried."""
    outcomes: list[GroupOutcome | None] = []
    sent: list[Sequence[GenerationRequest]] = []
    for group in groups:
        try:
            for i, request in enumerate(group):
                check(request, i)
        except Exception as exc:  # noqa: BLE001 - this group's own failure
            outcomes.append(group_error(exc))
            continue
        outcomes.append(None)
        sent.append(group)
    try:
        results = iter(generate(sent))
    except Exception as exc:  # noqa: BLE001 - the call's groups fail together
        error = group_error(exc)
        return [error if o is None else o for o in outcomes]
    return [next(results) if o is None else o for o in outcomes]


def raise_if_all_failed(outcomes: Sequence[GroupOutcome], succeeded_before: bool = False) -> None:
    """Raise the first error (the original exception where this rank has it) when no group
    succeeded: the engine failed, not a request."""
    if outcomes and not succeeded_before and all(isinstance(o, RolloutError) for o in outcomes):
        first = outcomes[0]
        assert isinstance(first, RolloutError)
        cause = first.__cause__
        raise cause if isinstance(cause, Exception) else first
