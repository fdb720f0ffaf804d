"""The per-step view of the controller that the trainer acts on.

A :class:`Snapshot` is taken once per training step (``ControllerCore.snapshot()``), on rank 0,
and broadcast to every rank, so all ranks agree on which adapter owns which slot. It is a frozen,
picklable dataclass; the specs inside are private copies, so nothing the trainer does to them
reaches the controller.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_multilora.config.adapter import AdapterSpec


@dataclass(frozen=True)
class SlotAssignment:
    """One adapter resident in one slot for this step.

    ``needs_init``: the trainer must (re)initialise the slot before training it: fresh LoRA init
    from ``spec.seed`` when ``resume_checkpoint`` is None, else load that checkpoint (after a
    controller restart, or when a requeued adapter got a slot again). It stays True in later
    snapshots until the trainer reports a step that includes this adapter (a missing or unreadable
    resume checkpoint falls back to the run's newest readable one, reported as ``resumed``).
    ``step``: optimizer steps applied to the slot's weights so far; ``version`` is the weight
    version samples are tagged with (equal to ``step``: the weights after ``step`` updates).
    """

    name: str
    run_id: str
    slot: int
    spec: AdapterSpec
    step: int
    version: int
    resume_checkpoint: str | None
    needs_init: bool
    remote: bool = False  # the spec came over the network: only operator-registered code may run


@dataclass(frozen=True)
class Snapshot:
    """``running`` adapters get new prompts and train; ``draining`` adapters only finish in-flight
    rollouts (no new prompts) and then get a final checkpoint (``drained``); ``slots_to_clear``
    must be cleared (``clear_slot``) and reported with ``slot_cleared`` before they are reused."""

    snapshot_id: int
    num_slots: int
    running: tuple[SlotAssignment, ...]
    draining: tuple[SlotAssignment, ...]
    slots_to_clear: tuple[int, ...]

    @property
    def adapters(self) -> tuple[SlotAssignment, ...]:
        """Every adapter resident this step (running first, then draining)."""
        return self.running + self.draining

    def by_name(self, name: str) -> SlotAssignment | None:
        return next((a for a in self.adapters if a.name == name), None)

    def slot_of(self) -> dict[str, int]:
        """Adapter name -> slot for every resident adapter."""
        return {a.name: a.slot for a in self.adapters}
