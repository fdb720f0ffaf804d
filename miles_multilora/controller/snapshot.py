"""The per-step view of the controller that the trainer acts on, and the trainer's report back.

A :class:`Snapshot` is taken once per training step (``ControllerCore.snapshot()``) and passed to
every rank, so all ranks agree on which adapter owns which slot. It is a frozen, picklable
dataclass; the specs inside are private copies, so nothing the trainer does to them reaches the
controller. Its mirror, the :class:`StepReport` a rank returns, says what the step did to each
adapter and slot of the snapshot (``ControllerCore.report_step`` and friends record it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.controller.errors import ControllerError


@dataclass(frozen=True)
class SlotAssignment:
    """One adapter resident in one slot for this step.

    ``needs_init``: the trainer must (re)initialise the slot before training it: fresh LoRA init
    from ``spec.seed`` when ``resume_checkpoint`` is None, else load that checkpoint (after a
    controller restart, or when a requeued adapter got a slot again). It stays True in later
    snapshots until the trainer reports a step that includes this adapter (a missing or unreadable
    resume checkpoint falls back to the run's newest readable one, reported as ``resumed``).
    ``step``: optimizer steps applied to the slot's weights so far (the weight version its samples
    are tagged with is the trainer rank's, which counts the same steps).
    """

    name: str
    run_id: str
    slot: int
    spec: AdapterSpec
    step: int
    resume_checkpoint: str | None
    needs_init: bool
    remote: bool = False  # the spec came over the network: only operator-registered code may run


@dataclass(frozen=True)
class Snapshot:
    """``running`` adapters get new prompts and train; ``draining`` adapters only finish in-flight
    rollouts (no new prompts) and then get a final checkpoint (``drained``); ``slots_to_clear``
    must be cleared (``clear_slot``) and reported with ``slot_cleared`` before they are reused.
    ``parked``: RUNNING adapters without a slot this step (``controller.max_running`` above the
    slots): the trainer parks those it holds, before it starts the others in their slots.
    ``next_turn``: the parked ones the turn rule expects to get a slot in the next snapshot (each
    resident training its usual tokens), most likely first: the trainer may start copying their
    state back to the GPU while this step runs. A hint only: the next snapshot decides."""

    snapshot_id: int
    num_slots: int
    running: tuple[SlotAssignment, ...]
    draining: tuple[SlotAssignment, ...]
    slots_to_clear: tuple[int, ...]
    parked: tuple[str, ...] = ()
    next_turn: tuple[str, ...] = ()

    @property
    def adapters(self) -> tuple[SlotAssignment, ...]:
        """Every adapter resident this step (running first, then draining)."""
        return self.running + self.draining

    def by_name(self, name: str) -> SlotAssignment | None:
        return next((a for a in self.adapters if a.name == name), None)


@dataclass(frozen=True)
class Resumed:
    """The trainer resumed an adapter from ``checkpoint`` (at ``step``), not from the one the
    controller named (that one was missing or unreadable)."""

    checkpoint: str
    step: int


@dataclass(frozen=True)
class AdapterResult:
    """What one step did to one resident adapter: whether it ``trained`` (one optimizer step that
    moved its weights), its ``step`` count after it (None: not reported), the complete
    ``checkpoint`` written at that step (if any), its ``metrics``, and where it ``resumed`` from."""

    trained: bool
    step: int | None = None
    checkpoint: str | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    resumed: Resumed | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.trained, bool):
            raise ControllerError(f"an adapter result needs a bool 'trained', got {self.trained!r}")
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int)):
            raise ControllerError(f"an adapter result's 'step' must be an int, got {self.step!r}")
        if not isinstance(self.metrics, Mapping):
            raise ControllerError(
                f"an adapter result's 'metrics' must be a dict, got {type(self.metrics).__name__}"
            )


@dataclass(frozen=True)
class StepReport:
    """What one training step did with its :class:`Snapshot`.

    ``results``: each running adapter that was stepped (or found at its budget); ``finished``: the
    final checkpoint of each adapter that reached its budget; ``drained``: the final checkpoint of
    each draining adapter; ``failed``: the reason of each adapter that failed (an adapter may be in
    ``results`` too: its last step counts); ``cleared``: the slots of ``slots_to_clear``, now
    cleared; ``timing``: seconds per phase and the step's throughput."""

    snapshot_id: int
    results: Mapping[str, AdapterResult]
    finished: Mapping[str, str]
    failed: Mapping[str, str]
    drained: Mapping[str, str]
    cleared: tuple[int, ...]
    timing: Mapping[str, float]
