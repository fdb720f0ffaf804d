"""Rewards that arrive on their own time: a step trains the adapters whose rewards are in.

Generated groups are handed to :class:`PendingRewards`, which scores each adapter's samples in the
background on global rank 0 (:meth:`~miles_multilora.data.RewardManager.start`). A step then waits
for the rewards still out at most ``trainer.reward_wait_s`` and goes on with the adapters whose
rewards are in; a late adapter's groups wait (they are *pending*) and train at the first step after
its rewards arrived, so a slow or hanging reward never holds another adapter's step. An adapter
whose last scoring was late is not waited for at all (it would cost every step that wait again);
it is again once a scoring of its is in within the wait. A pending adapter draws and generates
nothing new (its weights must move first), like an incomplete group in continuous rollout. Its
scoring ends by its own bounds (``reward.timeout_s`` per call, ``trainer.reward_step_timeout_s``
for all), when a failed scoring drops its groups and counts towards
``reward.max_consecutive_failures``.

What arrived is decided on rank 0 and broadcast, so every rank trains the same groups. Parking,
cancelling (draining) or forgetting an adapter drops its pending groups at once: its scoring in
flight is abandoned (its reward process killed) and their prompts are drawn again later (a
checkpoint lists them as untrained).
"""

from __future__ import annotations

from collections.abc import Collection

from miles_multilora.data import RewardManager, RewardSample
from miles_multilora.data.records import PromptItem
from miles_multilora.data.reward_manager import AdapterRewards
from miles_multilora.rl.adapters import Residents
from miles_multilora.rl.rollout import Group

GroupRewards = tuple[list[float], list[bool | None]]


class PendingRewards:
    """Each adapter's groups whose rewards are not in yet (the same on every rank), and their
    scoring (on rank 0)."""

    def __init__(
        self, residents: Residents, rewards: RewardManager, wait_s: float, *, training: bool = True
    ) -> None:
        """``training``: the groups are training prompts (a parked adapter's go back to its data);
        else held-out eval groups (dropped on parking)."""
        self.residents = residents
        self.rank = residents.rank
        self.rewards = rewards
        self.wait_s = wait_s
        self.pending: dict[str, list[Group]] = {}
        self._late: set[str] = set()  # rank 0: adapters whose last scoring was not in within the wait
        residents.on_forget.append(self.drop)
        residents.on_park.append(self.put_back if training else self.drop)

    # ----------------------------------------------------------------- bookkeeping
    def busy(self, name: str) -> bool:
        """Whether ``name`` has groups waiting for their rewards."""
        return name in self.pending

    def items(self, name: str) -> list[PromptItem]:
        """The prompts of ``name``'s pending groups (drawn, not trained), in draw order."""
        return [g.item for g in self.pending.get(name, [])]

    def drop(self, name: str) -> list[Group]:
        """Forget ``name``'s pending groups at once (its scoring in flight is abandoned, its reward
        process killed); returns them."""
        groups = self.pending.pop(name, [])
        self._late.discard(name)
        if self.rank.is_writer and name in self.rewards.names:
            self.rewards.abandon(name)
        return groups

    def put_back(self, name: str) -> None:
        """``name`` is parked: its pending groups are dropped and their prompts go back first to
        its data (generated anew when it has a slot again)."""
        items = [g.item for g in self.drop(name)]
        if items:
            self.residents.data.put_back(name, items)

    # ----------------------------------------------------------------- scoring
    def submit(self, groups: list[Group]) -> None:
        """Start scoring ``groups`` (their adapters must not be pending already)."""
        busy = sorted({g.adapter for g in groups} & set(self.pending))
        if busy:
            raise RuntimeError(f"adapters {busy} are being scored already")
        batch: dict[str, list[RewardSample]] = {}
        for g in groups:
            self.pending.setdefault(g.adapter, []).append(g)
            max_new_tokens = self.residents[g.adapter].spec.sampling.max_new_tokens
            for r in g.results:
                sample = RewardSample.from_item(g.item, r.text or "", response_length=len(r.output_ids))
                sample.max_new_tokens = max_new_tokens
                batch.setdefault(g.adapter, []).append(sample)
        if self.rank.is_writer and batch:
            self.rewards.start(batch)

    def collect(
        self, names: Collection[str] | None = None, idle: bool = False
    ) -> tuple[list[Group], dict[str, AdapterRewards]]:
        """The pending groups of ``names`` (default: all) whose rewards are in, with each adapter's
        reward report; a collective. Rank 0 waits at most ``wait_s`` for the adapters not late;
        ``idle`` (the step has nothing else to train): for any one of them, late or not."""
        names = [n for n in (self.pending if names is None else names) if n in self.pending]
        arrived = self._arrived_here(names, idle) if self.rank.is_writer else None
        reports, per_group = self.rank.broadcast(arrived)
        groups: list[Group] = []
        for name in reports:
            mine = self.pending.pop(name)
            for group, (values, correct) in zip(mine, per_group[name], strict=True):
                group.rewards, group.correct = values, correct
            groups += mine
        return groups, reports

    def _arrived_here(
        self, names: list[str], idle: bool
    ) -> tuple[dict[str, AdapterRewards], dict[str, list[GroupRewards]]]:
        """Rank 0: wait by the rule, take what arrived, split each adapter's rewards to its groups."""
        waited = [n for n in names if n not in self._late]
        if waited:
            self.rewards.wait(waited, self.wait_s)
        elif idle and names:
            self.rewards.wait(names, self.wait_s, any_of=True)
        for name in names:
            latency = self.rewards.latency(name)
            on_time = latency is not None and latency <= self.wait_s and name in self.rewards.finished([name])
            if on_time:
                self._late.discard(name)
            else:
                self._late.add(name)
        reports = self.rewards.take(names)
        per_group: dict[str, list[GroupRewards]] = {}
        for name, report in reports.items():
            start, out = 0, []
            for g in self.pending[name]:
                n = len(g.results)
                if report.rewards is None:  # this scoring failed: the groups train nothing
                    out.append(([], []))
                else:
                    correct = report.correct or [None] * (start + n)
                    out.append((list(report.rewards[start : start + n]), list(correct[start : start + n])))
                start += n
            per_group[name] = out
        return reports, per_group
