"""Adapter and slot states, and the one table of legal adapter transitions.

Adapter life cycle::

    PENDING --(slot granted at a snapshot)--> RUNNING --(budget reached, final ckpt)--> DONE
       |                                        |  \\
       | cancel                          cancel |   `--(error)--> FAILED
       v                                        v
    CANCELLED <--(final ckpt written)------ DRAINING --(error)--> FAILED
                                                `--(budget reached while draining)--> DONE

``RUNNING -> PENDING`` only happens in :meth:`ControllerCore.restore` when a restarted controller
has fewer slots than live adapters (a DRAINING one is then CANCELLED at its last checkpoint). Slots: ``FREE -> owned -> DIRTY -> FREE``; a DIRTY
slot becomes FREE only when the trainer reports it cleared.
"""

from __future__ import annotations

from enum import StrEnum

from miles_multilora.controller.errors import IllegalTransitionError


class AdapterState(StrEnum):
    PENDING = "PENDING"  # registered, waiting for a free slot
    RUNNING = "RUNNING"  # owns a slot, receives prompts and trains
    DRAINING = "DRAINING"  # cancelled: in-flight rollouts finish, no new prompts, then a final checkpoint
    DONE = "DONE"  # budget reached, final checkpoint written
    CANCELLED = "CANCELLED"  # cancelled by the user (after draining when it was running)
    FAILED = "FAILED"  # stopped by an error; ``reason`` says which

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATES

    @property
    def owns_slot(self) -> bool:
        return self in (AdapterState.RUNNING, AdapterState.DRAINING)


FINISHED_STATES = frozenset({AdapterState.DONE, AdapterState.CANCELLED, AdapterState.FAILED})
LIVE_STATES = frozenset({AdapterState.PENDING, AdapterState.RUNNING, AdapterState.DRAINING})

TRANSITIONS: dict[AdapterState, frozenset[AdapterState]] = {
    AdapterState.PENDING: frozenset({AdapterState.RUNNING, AdapterState.CANCELLED, AdapterState.FAILED}),
    AdapterState.RUNNING: frozenset(
        {AdapterState.DRAINING, AdapterState.DONE, AdapterState.FAILED, AdapterState.PENDING}
    ),
    AdapterState.DRAINING: frozenset({AdapterState.CANCELLED, AdapterState.DONE, AdapterState.FAILED}),
    AdapterState.DONE: frozenset(),
    AdapterState.CANCELLED: frozenset(),
    AdapterState.FAILED: frozenset(),
}


def check_transition(name: str, current: AdapterState, target: AdapterState) -> None:
    """Raise :class:`IllegalTransitionError` unless ``current -> target`` is in :data:`TRANSITIONS`."""
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (finished)"
        raise IllegalTransitionError(
            f"adapter {name!r} cannot go from {current.value} to {target.value}; allowed from "
            f"{current.value}: {allowed}"
        )


class SlotState(StrEnum):
    FREE = "FREE"  # cleared, may be granted to a PENDING adapter
    OWNED = "OWNED"  # held by a RUNNING or DRAINING adapter
    DIRTY = "DIRTY"  # its owner ended; the trainer must clear it before reuse
