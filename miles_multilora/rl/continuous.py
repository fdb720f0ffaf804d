"""Continuous rollout: the engine keeps decoding across steps; a step trains the groups that are
complete and never waits for samples it does not train.

Each adapter's prompt groups are drawn in order, and group ``i`` of adapter ``A`` belongs to the
step at which ``A``'s weights are at version ``i // prompts_per_step`` (its *target*). A group is
submitted to the engine as soon as ``A`` is within ``max_staleness`` versions of its target, so
while one step's longest samples finish, the batch fills with the next steps' groups instead of
draining. Unfinished groups keep their rows and KV pages across the optimizer step and go on with
the new weights: every output token carries the version that sampled it and its behaviour logprob
(the policy loss's importance ratio is taken against it), and no token is older than
``max_staleness`` versions when it trains.

An adapter steps when every group of its current target is complete (on every DP rank: each rank
generates and keeps its own groups, the ready set is agreed). With per-adapter pace a run of the
engine also ends when the batch drains (nothing waits, fewer than ``occupancy_floor`` of the rows
decode) and the adapters that are ready bring at least ``1 - occupancy_floor`` of the rows in new
work: they train and refill the batch while the others go on decoding. (Waiting until the ready
ones could refill every free row kept ready adapters idle for most of a long-sample run.) ``max_staleness=0`` is never served here: it is the synchronous step.

Samples in flight are not checkpointed: an adapter's checkpoint lists the prompts it drew and did
not train yet, and a resumed adapter draws those again first (they are generated anew).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from miles_multilora.data.records import PromptItem
from miles_multilora.rl.adapters import Residents
from miles_multilora.rl.faults import AdapterFailures
from miles_multilora.rl.rollout import Group, build_groups, training_requests
from miles_multilora.rollout.continuous_batching import StreamState
from miles_multilora.trainer.stream import StreamGroup

log = logging.getLogger(__name__)


@dataclass
class Carried:
    """A group drawn for one adapter's ``target`` step, in the rank's stream session as ``sent``."""

    group: Group
    target: int
    sent: StreamGroup

    @property
    def owner(self) -> int:
        """The DP rank that generates the group."""
        return self.sent.owner

    @property
    def ids(self) -> list[int]:
        """The engine's request ids of the group (on the owner's ranks; none elsewhere)."""
        return self.sent.ids


class ContinuousRollout:
    """The groups each adapter has drawn and not trained yet, and the engine runs that finish them."""

    def __init__(
        self,
        residents: Residents,
        max_staleness: int,
        *,
        pace: bool = True,
        occupancy_floor: float = 0.8,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"continuous rollout needs max_staleness >= 1, got {max_staleness}")
        self.residents = residents
        self.rank = residents.rank
        self.stream = residents.rank.stream()  # groups are numbered there: the same on every rank
        self.max_staleness = max_staleness
        self.pace = pace
        self.occupancy_floor = occupancy_floor
        self.carried: dict[str, list[Carried]] = {}
        self.next_target: dict[str, int] = {}
        residents.on_forget.append(self.forget)
        residents.on_park.append(self.put_back)

    # ----------------------------------------------------------------- bookkeeping
    def forget(self, name: str) -> None:
        """Drop ``name``'s carried groups (its engine rows give their pages back)."""
        mine = self.carried.pop(name, [])
        self.next_target.pop(name, None)
        self.stream.cancel([c.sent for c in mine])

    def put_back(self, name: str) -> None:
        """``name`` is parked: its carried groups are cancelled and their prompts go back to its
        data, drawn again first when it has a slot again (generated anew, none lost)."""
        items = self.carried_items(name)
        self.forget(name)
        self.residents.data.put_back(name, items)

    def carried_items(self, name: str) -> list[PromptItem]:
        """The prompts ``name`` drew and has not trained yet, in draw order."""
        return [c.group.item for c in self.carried.get(name, [])]

    def has_carried(self, name: str) -> bool:
        return bool(self.carried.get(name))

    def step_skipped(self, name: str) -> None:
        """``name`` took its step's groups but its weights did not move (nothing trainable, a
        vetoed update, a failed reward): its later groups move one step earlier, so the next step
        has its groups and new ones may be drawn (else it would stay ready with nothing due)."""
        for c in self.carried.get(name, []):
            c.target -= 1
        if name in self.next_target:
            self.next_target[name] -= 1

    # ----------------------------------------------------------------- drawing
    def draw(self, names: Iterable[str], failures: AdapterFailures) -> None:
        """Draw every group each adapter may start now (targets up to its version +
        ``max_staleness``, within its step budget) and submit this rank's share to the engine."""
        data = self.residents.data
        new: list[tuple[str, Group, int]] = []  # (adapter, group, target), in draw order
        for name in names:
            adapter = self.residents[name]
            version = self.residents.version(name)
            last = version + self.max_staleness
            if adapter.spec.num_steps is not None:
                last = min(last, adapter.spec.num_steps - 1)
            target = max(self.next_target.get(name, version), version)
            while target <= last:
                try:
                    items = data.refill(name, adapter.spec.prompts_per_step)
                except Exception as exc:  # noqa: BLE001 - isolated per adapter
                    failures.add(name, "drawing its prompts", exc)
                    break
                if not items:
                    break  # its data is exhausted
                groups = build_groups(self.residents, {name: items}, training_requests, failures)
                if name in failures:
                    break
                new += [(name, g, target) for g in groups]
                target += 1
            self.next_target[name] = target
        sent = self.stream.submit([g.requests for _, g, _ in new])  # this rank's share decodes here
        for (name, g, target), s in zip(new, sent, strict=True):
            self.carried.setdefault(name, []).append(Carried(g, target, s))
            if s.error is not None:  # refused by this rank's engine: the caller's failures.agree()
                failures.add(name, "generating its samples", s.error)  # tells every rank

    # ----------------------------------------------------------------- running
    def _due(self, name: str) -> list[Carried]:
        version = self.residents.version(name)
        return [c for c in self.carried.get(name, []) if c.target <= version]

    def _ready_here(self, name: str, state: StreamState) -> bool:
        return all(c.sent.finished(state) for c in self._due(name))

    def run(self, names: list[str]) -> list[str]:
        """Decode until some adapters in ``names`` have every group of their current step complete
        on every DP rank (all of them without per-adapter pace); returns those adapters."""
        strict = not self.pace
        while True:
            stop = self._stop_condition(names, strict)
            state = self.stream.run(stop)
            here = {n for n in names if self._ready_here(n, state)}
            if len(here) < len(names) and state.active_rows + state.waiting_rows == 0:
                raise RuntimeError(
                    f"the engine has nothing left to decode but {sorted(set(names) - here)} wait"
                )
            everywhere = set(names)
            for part in self.rank.gather(sorted(here)):
                everywhere &= set(part)
            if everywhere:
                return [n for n in names if n in everywhere]
            strict = True  # the ranks were ready for different adapters: finish them all

    def _stop_condition(self, names: list[str], strict: bool) -> Callable[[StreamState], bool]:
        """When an engine run ends: every adapter of ``names`` is ready here, or (with per-adapter
        pace, ``strict`` off) more than ``1 - occupancy_floor`` of the rows are free and the ready
        ones bring at least that many rows of new work (a pause to train is worth it)."""

        def stop(state: StreamState) -> bool:
            ready = [n for n in names if self._ready_here(n, state)]
            if len(ready) == len(names):
                return True
            if strict or not ready or state.waiting_rows:
                return False
            enough = (1 - self.occupancy_floor) * state.max_rows
            return state.max_rows - state.active_rows > enough and self._refill_rows(ready) >= enough

        return stop

    def _refill_rows(self, names: list[str]) -> int:
        """Rows one more step of each of ``names`` brings (its prompts x samples)."""
        return sum(
            self.residents[n].spec.prompts_per_step * self.residents[n].spec.n_samples_per_prompt
            for n in names
        )

    def collect(self, names: list[str]) -> list[Group]:
        """Each of ``names``' groups of its current step with its results (on every rank), taken
        out of the carried ones, in draw order."""
        due = [c for name in names for c in self._due(name)]
        for c, results in zip(due, self.stream.take([c.sent for c in due]), strict=True):
            c.group.results = results
        groups = [c.group for c in due]
        for name in names:
            version = self.residents.version(name)
            self.carried[name] = [c for c in self.carried.get(name, []) if c.target > version]
        return groups


def staleness_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """How old the trained tokens are (versions behind ``version``): max and token-weighted mean."""
    ages = [version - v for g in groups for r in g.results for v in r.versions()]
    if not ages:
        return {}
    return {"staleness_max": float(max(ages)), "staleness_mean": sum(ages) / len(ages)}
