"""Who holds a rank's slots, and whose state waits off the GPU: one residency for both doors.

A :class:`Residency` names each holder's slot (``slots``) or its parked state (``parked``,
:mod:`~miles_multilora.trainer.offload`). It opens, closes, parks and restores holders on the rank,
spills the least recently used parked states to disk past ``host_bytes`` of host memory, and
starts the copies of those needed next back to the GPU ahead of their restore (:meth:`prefetch`).
Its LRU clock ticks at every open, restore and :meth:`touch`. Which holder gives its slot up, and
when, is the door's choice (the RL recipe follows the controller's turns, the Tinker backend
parks its least recently used model).

Readers on other threads may look a holder up while it moves: a holder being parked is in
``parked`` before it leaves ``slots``, one being restored in ``slots`` before it leaves ``parked``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.trainer.host_copies import device_room
from miles_multilora.trainer.offload import ParkedSlot, park, spill_over_budget, unpark
from miles_multilora.trainer.rank import OpenSlot, TrainerRank
from miles_multilora.trainer.slot_rows import PackedRows

PREFETCH_MARGIN = 1 << 30  # device memory a prefetch leaves free at the step's peak


class Residency:
    """Holder name -> its slot on ``rank``, or its parked state (see the module docstring)."""

    def __init__(
        self, rank: TrainerRank, *, host_bytes: int, spill_dir: str | Path, prefetch_bytes: int
    ) -> None:
        self.rank = rank
        self.host_bytes = host_bytes  # parked state held in host memory; past it, to disk
        self.spill_dir = Path(spill_dir)  # a spilled holder's state: spill_dir / name
        self.prefetch_bytes = prefetch_bytes  # device memory for copies on their way back
        self.slots: dict[str, int] = {}
        self.parked: dict[str, ParkedSlot] = {}
        self._used: dict[str, int] = {}  # holder -> the clock at its last open, restore or touch
        self._clock = itertools.count(1)
        self._ahead: set[str] = set()  # the parked holders the last prefetch named
        # restores whose holder the last prefetch named (its copy on its way, on a GPU): a right guess
        self.stats = {"parked": 0, "restored": 0, "spilled": 0, "prefetch_hits": 0}

    def __contains__(self, name: object) -> bool:
        return name in self.slots or name in self.parked

    def touch(self, name: str) -> None:
        """``name`` is used now (the least recently used park and spill first)."""
        self._used[name] = next(self._clock)

    def last_used(self, name: str) -> int:
        return self._used.get(name, 0)

    def open(
        self, name: str, slot: int, rank: int, alpha: float, seed: int, optimizer: OptimizerSpec, *,
        total_steps: int | None = None, run: str = "", restore: str | Path | dict | PackedRows | None = None,
        targets: Sequence[str] | None = None,
    ) -> OpenSlot:  # fmt: skip
        """Open free ``slot`` for the new holder ``name`` (:meth:`TrainerRank.open_slot`); on
        failure the slot is left free."""
        try:
            opened = self.rank.open_slot(
                slot, rank, alpha, seed, optimizer, name,
                total_steps=total_steps, run=run, restore=restore, targets=targets,
            )  # fmt: skip
        except BaseException:
            held = self.rank.slots.get(slot)
            if held is not None and held.name == name:
                self.rank.close_slot(slot)
            raise
        self.slots[name] = slot
        self.touch(name)
        return opened

    def close(self, name: str) -> None:
        """Forget ``name``: its slot closed (when the rank's slot is still its own) or its parked
        state discarded, spill included. Nothing when it holds nothing."""
        slot = self.slots.pop(name, None)
        parked = self.parked.pop(name, None)
        self._used.pop(name, None)
        self._ahead.discard(name)
        if parked is not None:
            parked.discard()
        opened = self.rank.slots.get(slot) if slot is not None else None
        if opened is not None and opened.name == name:
            self.rank.close_slot(slot)  # type: ignore[arg-type] - not None with ``opened``

    def park(self, name: str) -> ParkedSlot:
        """Move resident ``name``'s whole slot state off the GPU and close its slot; then spill
        past ``host_bytes``."""
        slot = self.slots[name]
        self.parked[name] = parked = park(self.rank, slot)
        del self.slots[name]
        self.rank.close_slot(slot)
        self.stats["parked"] += 1
        self.spill()
        return parked

    def spill(self) -> int:
        """Move the least recently used parked states to disk while those in host memory hold more
        than ``host_bytes``; returns how many moved."""
        spilled = spill_over_budget(
            self.parked, self.host_bytes, self.spill_dir, self.rank.layout.tp_rank, self.last_used
        )
        self.stats["spilled"] += spilled
        return spilled

    def restore(self, name: str, slot: int) -> OpenSlot:
        """Put parked ``name`` into free ``slot``, exactly as it was. On failure it stays parked
        and the slot free."""
        parked = self.parked[name]
        try:
            opened = unpark(self.rank, parked, slot)
        except BaseException:
            if slot in self.rank.slots:
                self.rank.close_slot(slot)
            raise
        self.slots[name] = slot
        del self.parked[name]
        parked.discard()  # its spill on disk, if any
        self.stats["restored"] += 1
        self.stats["prefetch_hits"] += name in self._ahead
        self._ahead.discard(name)
        self.touch(name)
        return opened

    def prefetch(self, names: Sequence[str]) -> int:
        """Start copying parked ``names`` (needed next, most likely first) back to the GPU while
        the current work runs, within ``prefetch_bytes`` of device memory and what the device can
        hold at the step's peak (less a 1 GiB margin); copies started for others are given back. A
        hint only: a wrong guess costs a copy. Returns how many are on their way (none on a CPU or
        for a state spilled to disk)."""
        wanted = [n for n in dict.fromkeys(names) if n in self.parked]
        self._ahead = set(wanted)
        for name, parked in self.parked.items():
            if name not in self._ahead:
                parked.drop_prefetch()
        if self.rank.device.type != "cuda":
            return 0
        room = device_room(self.rank.device) - PREFETCH_MARGIN  # the new ones (the others hold theirs)
        used = sum(p.staged.nbytes for p in self.parked.values() if p.staged is not None)
        for name in wanted:
            parked = self.parked[name]
            if parked.can_prefetch and used + parked.nbytes <= self.prefetch_bytes and parked.nbytes <= room:
                started = parked.prefetch()
                used, room = used + started, room - started
        return sum(self.parked[n].staged is not None for n in wanted)
