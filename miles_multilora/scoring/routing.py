"""Route each token of a forward pass to its LoRA slot (``-1`` = base model only)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from miles_multilora.errors import RolloutError
from miles_multilora.lora.inject import model_num_slots, token_slots
from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.lora.routing import row_routing_plan


def has_multi_lora(model: torch.nn.Module) -> bool:
    """Whether the model has MultiLoRA layers (a plain base model can only serve slot -1)."""
    return any(isinstance(m, MultiLoRALinear) for m in model.modules())


def check_servable_slots(model: torch.nn.Module, slots: Sequence[int]) -> bool:
    """Raise if adapter slots are asked of a model without MultiLoRA layers; return whether it has them."""
    routed = has_multi_lora(model)
    if not routed and any(s >= 0 for s in slots):
        raise RolloutError(
            "the model has no MultiLoRA layers (apply_multi_lora first); only slot -1 can be served"
        )
    return routed


def row_routing(
    model: torch.nn.Module, slots: Sequence[int], seq_len: int, device: torch.device, routed: bool = True
) -> AbstractContextManager:
    """Context manager routing every token of row ``b`` (of ``seq_len``) to ``slots[b]``; the plan is
    built from the host's list, so the host never waits for the GPU. ``routed=False`` (from
    :func:`check_servable_slots`) is for a plain base model: nothing to route."""
    if not routed:
        return nullcontext()
    return token_slots(model, row_routing_plan(slots, seq_len, model_num_slots(model), device))
