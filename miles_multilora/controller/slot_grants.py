"""The slot-granting half of :class:`~miles_multilora.controller.core.ControllerCore`.

FIFO grants of free slots, admission under ``max_running``, the turn rule's view of the RUNNING
adapters (:mod:`.residency`) and why a quota holds an adapter back. A mixin over the core's state
(its runs, slot table, residency policy and token window); every caller holds the core's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from miles_multilora.controller.quotas import TokenWindow, quota_note
from miles_multilora.controller.record import AdapterRecord
from miles_multilora.controller.residency import Candidate, ResidencyPolicy, choose_residents
from miles_multilora.controller.slot_table import SlotTable
from miles_multilora.controller.states import AdapterState


class SlotGrants:
    """Who gets a slot, and who waits for which quota (the core's state, read and changed under its lock)."""

    num_slots: int
    residency: ResidencyPolicy
    _runs: dict[str, AdapterRecord]
    _slots: SlotTable
    _tokens: TokenWindow
    _clock: Callable[[], float]

    def _transition(self, record: AdapterRecord, target: AdapterState) -> None:
        raise NotImplementedError  # the core's

    def _own(self, record: AdapterRecord, slot: int) -> None:
        """Give ``slot`` to ``record`` (its state starts afresh or from its checkpoint)."""
        self._slots.own(slot, record.run_id)
        record.slot = slot
        record.needs_init = True
        record.updated_at = self._clock()

    def _grant_free_slots(self) -> bool:
        """Give FREE slots to PENDING adapters (FIFO, passing over those whose tenant is at its
        ``max_running``); True when any was granted."""
        granted = False
        running = self._running_per_tenant()
        for record in sorted(
            (r for r in self._runs.values() if r.state is AdapterState.PENDING), key=lambda r: r.seq
        ):
            if self._at_max_running(record.tenant, running):
                continue
            slot = self._slots.free_slot()
            if slot is None:
                break
            running[record.tenant] = running.get(record.tenant, 0) + 1
            self._transition(record, AdapterState.RUNNING)
            if record.started_at is None:
                record.started_at = record.updated_at
            self._own(record, slot)
            granted = True
        return granted

    def _admit_running(self) -> bool:
        """PENDING -> RUNNING (FIFO, passing over those whose tenant is at its ``max_running``)
        while fewer than ``residency.max_running`` are active; True when any was admitted. They
        get slots by :meth:`_take_turns`."""
        limit = self.residency.max_running or self.num_slots
        running = self._running_per_tenant()
        active = sum(running.values())
        admitted = False
        for record in sorted(
            (r for r in self._runs.values() if r.state is AdapterState.PENDING), key=lambda r: r.seq
        ):
            if active >= limit:
                break
            if self._at_max_running(record.tenant, running):
                continue
            running[record.tenant] = running.get(record.tenant, 0) + 1
            self._transition(record, AdapterState.RUNNING)
            if record.started_at is None:
                record.started_at = record.updated_at
            record.needs_init = True
            active += 1
            admitted = True
        return admitted

    def _candidates(self, now: float, ahead: bool = False) -> list[Candidate]:
        """The turn rule's view of the RUNNING and DRAINING adapters (none of a tenant over its
        ``tokens_per_hour``, unless DRAINING); ``ahead``: as it will be after the next report, each
        resident one step longer in its slot with its mean tokens per step more served."""
        over = self._over_tokens(now)
        candidates = []
        for r in self._runs.values():
            if not r.state.owns_slot or (r.state is not AdapterState.DRAINING and r.tenant in over):
                continue
            resident, served, steps = r.slot is not None, r.served_tokens, r.resident_steps
            if ahead and resident:
                served, steps = served + served / max(r.step, 1), steps + 1
            candidates.append(
                Candidate(r.run_id, r.seq, served, resident, steps, r.state is AdapterState.DRAINING,
                          self.residency.quotas.priority_of(r.spec), r.spec.share)
            )  # fmt: skip
        return candidates

    def _next_turn(self, now: float) -> tuple[str, ...]:
        """The parked adapters the turn rule would give a slot in the next snapshot if every
        resident trained its mean tokens per step (:attr:`Snapshot.next_turn`), in its order."""
        chosen = choose_residents(
            self._candidates(now, ahead=True), self.num_slots, self.residency.min_residency_steps
        )
        parked = {r.run_id: r.name for r in self._runs.values() if r.state.owns_slot and r.slot is None}
        return tuple(parked[run_id] for run_id in chosen if run_id in parked)

    def _take_turns(self, now: float) -> bool:
        """Hand the slots to the adapters the turn rule picks (none of a tenant over its
        ``tokens_per_hour``, unless DRAINING): the others' slots are vacated (the trainer parks
        them before it starts anyone in this snapshot); True when anything moved."""
        active = [r for r in self._runs.values() if r.state.owns_slot]
        chosen = set(
            choose_residents(self._candidates(now), self.num_slots, self.residency.min_residency_steps)
        )
        moved = False
        for record in active:
            if record.slot is not None and record.run_id not in chosen:
                self._slots.vacate(record.slot)
                record.slot, record.resident_steps, moved = None, 0, True
        for record in sorted(active, key=lambda r: r.seq):
            if record.slot is None and record.run_id in chosen:
                slot = self._slots.free_slot()
                if slot is None:
                    break  # a slot still to be cleared: next snapshot
                self._own(record, slot)
                record.resident_steps, moved = 0, True
        return moved

    def _running_per_tenant(self) -> dict[str, int]:
        """Adapters RUNNING or DRAINING per tenant."""
        counts: dict[str, int] = {}
        for record in self._runs.values():
            if record.state.owns_slot:
                counts[record.tenant] = counts.get(record.tenant, 0) + 1
        return counts

    def _at_max_running(self, tenant: str, running: Mapping[str, int]) -> bool:
        limit = self.residency.quotas.of(tenant).max_running
        return bool(limit) and running.get(tenant, 0) >= limit

    def _over_tokens(self, now: float) -> dict[str, tuple[int, float]]:
        """Tenants at or over their ``tokens_per_hour``: tenant -> (limit, tokens in the window)."""
        self._tokens.prune(now)
        over = {}
        for tenant in {r.tenant for r in self._runs.values()}:
            limit = self.residency.quotas.of(tenant).tokens_per_hour
            if limit and (used := self._tokens.used(tenant, now)) >= limit:
                over[tenant] = (limit, used)
        return over

    def _account_parked(self, now: float) -> None:
        """Start or stop each RUNNING/DRAINING adapter's parked clock by whether it holds a slot."""
        for record in self._runs.values():
            record.mark_parked(record.state.owns_slot and record.slot is None, now)

    def _quota_notes(self, now: float) -> dict[str, dict[str, Any]]:
        """Why each live adapter held back by a quota waits: run id -> ``{tenant, limit, value,
        used, resumes_in_s}`` (a PENDING one at its tenant's ``max_running``; a parked RUNNING one
        over its tenant's ``tokens_per_hour``)."""
        notes: dict[str, dict[str, Any]] = {}
        running = self._running_per_tenant()
        over = self._over_tokens(now) if self.residency.takes_turns(self.num_slots) else {}
        for record in self._runs.values():
            tenant = record.tenant
            if record.state is AdapterState.PENDING and self._at_max_running(tenant, running):
                limit = self.residency.quotas.of(tenant).max_running
                notes[record.run_id] = quota_note(tenant, "max_running", limit, running[tenant])
            elif record.state is AdapterState.RUNNING and record.slot is None and tenant in over:
                limit, used = over[tenant]
                resumes_in_s = self._tokens.resumes_in(tenant, limit, now)
                notes[record.run_id] = quota_note(tenant, "tokens_per_hour", limit, used, resumes_in_s)
        return notes
