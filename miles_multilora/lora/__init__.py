"""Resident multi-slot LoRA: layers (dense and MoE experts), routing, injection, slot lifecycle and PEFT I/O."""

from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from miles_multilora.lora.inject import (
    ALL_LINEAR,
    apply_multi_lora,
    multi_lora_layers,
    set_token_slots,
    token_slots,
)
from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.lora.routing import RoutingPlan, build_routing_plan
from miles_multilora.lora.slots import (
    clear_slot,
    export_slot,
    init_slot,
    load_slot,
    load_slot_state,
    slot_rank,
    slot_state,
    slot_targets,
)
from miles_multilora.lora.targets import FAMILIES

__all__ = [
    "ALL_LINEAR",
    "FAMILIES",
    "MultiLoRAExpertLinear",
    "MultiLoRALinear",
    "RoutingPlan",
    "apply_multi_lora",
    "build_routing_plan",
    "clear_slot",
    "export_slot",
    "init_slot",
    "load_slot",
    "load_slot_state",
    "multi_lora_layers",
    "set_token_slots",
    "slot_rank",
    "slot_state",
    "slot_targets",
    "token_slots",
]
