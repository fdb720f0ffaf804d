"""The RL recipe (GRPO/DAPO on many adapters at once) as a client of a trainer rank's primitives.

- :mod:`.step` — :class:`RLStep`: one step per controller snapshot, phase by phase
- :mod:`.adapters` — :class:`ResidentAdapter` records and their start (fresh or resumed) and end
- :mod:`.rollout` — prompt groups: requests, samples and rewards attached to each group
- :mod:`.train` — GRPO rows, the per-slot normalised policy loss, the optimizer step
- :mod:`.evaluation` — held-out evaluation: when it is due, and its metrics
- :mod:`.checkpoint` / :mod:`.resume` — per-adapter checkpoints of a run, and resuming from them
- :mod:`.faults` — per-adapter failures, agreed on by every rank

``RLStep`` is imported on first use, so the light modules (checkpoints) do not import Megatron.
"""

from typing import Any

__all__ = ["RLStep"]


def __getattr__(name: str) -> Any:
    if name == "RLStep":
        from miles_multilora.rl.step import RLStep

        return RLStep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
