"""The controller's slot table: which run owns each resident slot, and which slots wait to be cleared.

A slot is FREE, OWNED by one run, or DIRTY (its run ended; the trainer must clear it before it is
granted again): FREE -> OWNED -> DIRTY -> FREE. Plain Python, no lock (the controller core holds it).
"""

from __future__ import annotations

from typing import Any

from miles_multilora.controller.errors import ControllerError, IllegalTransitionError
from miles_multilora.controller.states import SlotState


class SlotTable:
    """``num_slots`` slots, each with its state and (while OWNED) the run id that owns it."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.states = [SlotState.FREE] * num_slots
        self.owners: list[str | None] = [None] * num_slots

    def free_slot(self) -> int | None:
        """The lowest FREE slot, if any."""
        return next((i for i, s in enumerate(self.states) if s is SlotState.FREE), None)

    def own(self, slot: int, run_id: str) -> None:
        self.states[slot] = SlotState.OWNED
        self.owners[slot] = run_id

    def release(self, slot: int) -> None:
        """The owner ended: the slot is DIRTY until the trainer clears it."""
        self.states[slot] = SlotState.DIRTY
        self.owners[slot] = None

    def vacate(self, slot: int) -> None:
        """The owner is parked, not ended: the slot is FREE at once (the trainer parks its holder
        before it starts the next one)."""
        self.states[slot] = SlotState.FREE
        self.owners[slot] = None

    def cleared(self, slot: int) -> None:
        """The trainer cleared ``slot``: DIRTY -> FREE (a FREE slot stays FREE; an OWNED one raises)."""
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ControllerError(f"slot {slot!r} does not exist (num_slots={self.num_slots})")
        if self.states[slot] is SlotState.OWNED:
            raise IllegalTransitionError(
                f"slot {slot} is owned by run {self.owners[slot]}; only a DIRTY slot is cleared"
            )
        self.states[slot] = SlotState.FREE

    def dirty(self) -> tuple[int, ...]:
        """The slots the trainer must clear."""
        return tuple(i for i, s in enumerate(self.states) if s is SlotState.DIRTY)

    def counts(self) -> dict[str, int]:
        return {s.value: self.states.count(s) for s in SlotState}

    def reset(self) -> None:
        """Every slot FREE (after a restart: the trainer's slots are all fresh)."""
        self.states = [SlotState.FREE] * self.num_slots
        self.owners = [None] * self.num_slots

    def to_state(self) -> dict[str, Any]:
        return {"slots": [s.value for s in self.states], "slot_owners": list(self.owners)}

    def load(self, data: dict[str, Any]) -> None:
        self.states = [SlotState(s) for s in data["slots"]]
        self.owners = list(data["slot_owners"])
