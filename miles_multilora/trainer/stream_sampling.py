"""A sample call on the engine's stream (:meth:`~miles_multilora.trainer.rank.TrainerRank.sample`):
every group decodes in one batch, each is taken (and heard) at the first host check after its last
sample ends, and the call's :class:`GroupJoiner` may bring more groups, or run other work (a
training step), between two decode steps: rows keep their KV cache and sample their next tokens
with the weights that work leaves, each token tagged with the version that sampled it.

- :func:`sample_streaming`, one rank: the stream runs until a group ends or the joiner waits.
- :func:`sample_lockstep`, several ranks (DP, and TP within it): every rank runs one host-check
  interval of its own share of the groups, then the ranks agree (one object all-gather) on which
  groups ended on their owners, whether any rank's joiner waits, and whether a rank's stream failed.
  So every rank takes the same groups and calls :meth:`GroupJoiner.join` at the same host check:
  the joiners of a call are a collective (on the Tinker server rank 0's brings the work, and
  the other ranks' run the same work, :mod:`~miles_multilora.launch.tinker_ranks`).

When the stream fails (on any rank), the groups not heard yet are generated again, split around
the failing ones (``retry``; on several ranks, on every rank together).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from miles_multilora.rollout import GenerationRequest, RolloutError
from miles_multilora.rollout.continuous_batching import StreamState
from miles_multilora.rollout.isolation import GroupOutcome, raise_if_all_failed
from miles_multilora.trainer.stream import SampleStream, StreamGroup

Groups = Sequence[Sequence[GenerationRequest]]


class GroupJoiner(Protocol):
    """More groups for a running streaming batch (:meth:`TrainerRank.sample`)."""

    def waiting(self) -> bool:
        """Whether groups are waiting to join (asked at every host check: cheap)."""
        ...

    def join(self) -> Sequence[Sequence[GenerationRequest]]:
        """The groups that join now (possibly none); other work may run first, between decode
        steps (rows keep their KV and decode on with the weights it leaves). On several ranks it
        is called on every rank at the same host check (when any rank's joiner waits)."""
        ...

    def ran_between(self) -> bool:
        """Whether the last :meth:`join` ran other work (then it is asked again at once)."""
        ...


class _Call:
    """The groups of one call in a stream session: each by its number, those not taken yet."""

    def __init__(self, stream: SampleStream, on_group: Callable[[int, GroupOutcome], None]) -> None:
        self.stream, self.on_group = stream, on_group
        self.out: list[GroupOutcome] = []
        self.every: list[Sequence[GenerationRequest]] = []
        self.pending: dict[int, StreamGroup] = {}
        self.heard: set[int] = set()

    def submit(self, new: Groups) -> None:
        first = len(self.out)
        self.every.extend(new)
        self.out.extend([] for _ in new)
        for i, sent in enumerate(self.stream.submit(new), first):
            self.pending[i] = sent  # a group the engine refused is finished: taken as its error

    def take(self, done: list[int]) -> None:
        for i, results in zip(done, self.stream.take([self.pending.pop(i) for i in done]), strict=True):
            self.out[i] = results
            self.heard.add(i)
            self.on_group(i, results)

    def retry(self, retry: Callable[[Groups], list[GroupOutcome]]) -> list[GroupOutcome]:
        """The groups not heard yet, generated again by ``retry``."""
        self.stream.cancel(self.pending.values())
        left = [i for i in range(len(self.every)) if i not in self.heard]
        retried = retry([self.every[i] for i in left])
        raise_if_all_failed(retried, succeeded_before=bool(self.heard))
        for i, outcome in zip(left, retried, strict=True):
            self.out[i] = outcome
            self.on_group(i, outcome)
        return self.out


def sample_streaming(
    stream: SampleStream,
    groups: Groups,
    on_group: Callable[[int, GroupOutcome], None],
    joiner: GroupJoiner | None,
    retry: Callable[[Groups], list[GroupOutcome]],
) -> list[GroupOutcome]:
    """One rank's streaming sample call: the stream runs until a group ends or ``joiner`` waits."""
    call = _Call(stream, on_group)
    ask = joiner is not None
    try:
        call.submit(groups)
        while call.pending:
            state = stream.run(
                lambda st, ask=ask: (
                    any(g.finished(st) for g in call.pending.values()) or (ask and joiner.waiting())
                )  # type: ignore[union-attr]
            )
            done = [i for i, group in call.pending.items() if group.finished(state)]
            call.take(done)
            joined = list(joiner.join()) if joiner is not None else []
            if joined:
                call.submit(joined)
            elif not done and not ask:
                raise RolloutError("the engine's stream stopped with requests unfinished")
            # a wait that brought nothing is not asked again until the next group ends
            ask = joiner is not None and bool(done or joined or joiner.ran_between())
    except Exception:  # noqa: BLE001 - the groups not heard yet, split around the failing ones
        return call.retry(retry)
    except BaseException:
        stream.cancel(call.pending.values())
        raise
    raise_if_all_failed(call.out)  # every group refused by the engine: the call's error (every rank)
    return call.out


def _one_interval() -> Callable[[StreamState], bool]:
    """A stop condition that holds at the first host check after one run of decode steps."""
    checks = iter((False,))
    return lambda state: next(checks, True)


def sample_lockstep(
    stream: SampleStream,
    groups: Groups,
    on_group: Callable[[int, GroupOutcome], None],
    joiner: GroupJoiner,
    gather: Callable[[object], list],
    retry: Callable[[Groups], list[GroupOutcome]],
) -> list[GroupOutcome]:
    """A streaming sample call on every rank together (a collective): at each host check (the
    first before any decode step) the ranks agree on the groups that ended, then every rank joins
    when any rank's joiner waits, then every rank decodes one interval. ``gather``: every rank's
    value, in rank order."""
    call = _Call(stream, on_group)
    here = stream.layout.dp_rank
    first = True
    try:
        call.submit(groups)
        while call.pending:
            error, mine, busy = None, [], False
            try:
                state = stream.run((lambda st: True) if first else _one_interval())
            except Exception as exc:  # noqa: BLE001 - told to every rank below: all retry together
                error = f"{type(exc).__name__}: {exc}"
            else:
                mine = [i for i, g in call.pending.items() if g.owner == here and g.finished(state)]
                busy = state.active_rows + state.waiting_rows > 0
            first = False
            reports = gather((mine, busy, joiner.waiting(), error))
            failed = [(rank, e) for rank, (_, _, _, e) in enumerate(reports) if e is not None]
            if failed:
                raise RolloutError(f"the engine's stream failed on rank {failed[0][0]}: {failed[0][1]}")
            done = sorted({i for m, _, _, _ in reports for i in m})
            call.take(done)
            joined = list(joiner.join()) if any(w for _, _, w, _ in reports) else []
            if joined:
                call.submit(joined)
            elif call.pending and not done and not any(b for _, b, _, _ in reports):
                raise RolloutError("the engine's stream stopped with requests unfinished")
    except Exception:  # noqa: BLE001 - on every rank at once: the groups not heard yet, again
        return call.retry(retry)
    except BaseException:
        stream.cancel(call.pending.values())
        raise
    raise_if_all_failed(call.out)  # every group refused by the engine: the call's error (every rank)
    return call.out
