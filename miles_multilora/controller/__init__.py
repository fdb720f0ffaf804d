"""The MultiLoRA controller: which adapters train, in which slot, and their life cycle.

- :mod:`.core` — :class:`ControllerCore`, plain Python (registry, state machine, slots, persistence)
- :mod:`.snapshot` — :class:`Snapshot`, the immutable per-step view the trainer acts on, and
  :class:`StepReport`, the trainer's answer (an :class:`AdapterResult` per adapter)
- :mod:`.http_api` — :class:`ControllerHTTPServer`, the JSON HTTP API
- :mod:`.client` / :mod:`.commands` — HTTP client and the submit/status/cancel/list subcommands
- :mod:`.actor` — the named (detached in service mode) Ray actor; import it explicitly, this
  package does not import Ray.
"""

from miles_multilora.controller.core import ControllerCore
from miles_multilora.controller.errors import (
    AdapterConflictError,
    ControllerAuthError,
    ControllerError,
    ControllerStateError,
    ControllerUnavailableError,
    IllegalTransitionError,
    UnknownAdapterError,
)
from miles_multilora.controller.snapshot import AdapterResult, Resumed, SlotAssignment, Snapshot, StepReport
from miles_multilora.controller.states import AdapterState, SlotState

__all__ = [
    "AdapterConflictError",
    "AdapterResult",
    "AdapterState",
    "ControllerAuthError",
    "ControllerCore",
    "ControllerError",
    "ControllerStateError",
    "ControllerUnavailableError",
    "IllegalTransitionError",
    "Resumed",
    "SlotAssignment",
    "SlotState",
    "Snapshot",
    "StepReport",
    "UnknownAdapterError",
]
