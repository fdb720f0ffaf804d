"""Per-slot LoRA targets on the model: the families a slot holds (the families and their checks are
:mod:`miles_multilora.config.lora_targets`, plain Python for the controller)."""

from __future__ import annotations

from miles_multilora.config.lora_targets import (
    ATTN,
    FAMILIES,
    MLP,
    UNEMBED,
    check_targets,
    families_of_modules,
    family_of,
)

__all__ = [
    "ATTN",
    "FAMILIES",
    "MLP",
    "UNEMBED",
    "check_targets",
    "families_of_modules",
    "family_of",
    "held_families",
    "state_families",
]


def held_families(layer_ranks: dict[str, int]) -> tuple[str, ...]:
    """The families in which a slot holds a LoRA, from its per-layer ranks (layer key -> rank)."""
    held = {family_of(key) for key, rank in layer_ranks.items() if rank}
    return tuple(f for f in FAMILIES if f in held)


def state_families(slot_state: dict) -> tuple[str, ...]:
    """:func:`held_families` of a saved slot state (``<layer>.rank`` entries of ``slot_state``)."""
    return held_families(
        {name[: -len(".rank")]: int(t) for name, t in slot_state.items() if name.endswith(".rank")}
    )
