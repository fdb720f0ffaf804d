"""Inject MultiLoRA layers into a Megatron ``GPTModel`` (or any module tree) and route its tokens to
their slots (one :class:`~miles_multilora.lora.routing.RoutingPlan` per forward, shared by every layer)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from weakref import WeakKeyDictionary

import torch
from torch import nn

from miles_multilora.errors import ConfigError
from miles_multilora.lora.layer import MultiLoRALinear, check_kernels
from miles_multilora.lora.routing import RoutingPlan, build_routing_plan

ALL_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
KNOWN_TARGETS = (*ALL_LINEAR, "output_layer")
SHARED_EXPERTS = "shared_experts"  # an MoE layer's shared expert MLP (Megatron's module name)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _resolve_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ConfigError(
                "target_modules", f"must be 'all-linear' or a list of {KNOWN_TARGETS}, got {target_modules!r}"
            )
        return ALL_LINEAR
    targets = tuple(target_modules)
    unknown = [t for t in targets if t not in KNOWN_TARGETS]
    if unknown or not targets:
        raise ConfigError("target_modules", f"unknown {unknown or 'empty list'}: choose from {KNOWN_TARGETS}")
    return targets


def _stable_key(name: str, module: nn.Module, layer_offset: int) -> str:
    """``layers.{global index}.{leaf}`` for transformer layers (PP-stable; an MoE layer's shared
    expert: ``layers.{i}.shared_experts.{leaf}``), else the module path."""
    owner, _, leaf = name.rpartition(".")
    match = _LAYER_INDEX.search(name + ".")
    if match is None:
        return leaf
    shared = f"{SHARED_EXPERTS}." if owner.rsplit(".", 1)[-1] == SHARED_EXPERTS else ""
    return f"layers.{int(match.group(1)) + layer_offset}.{shared}{leaf}"


def _layer_offset(model: nn.Module) -> int:
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is not None and len(layers) and hasattr(layers[0], "layer_number"):
        return int(layers[0].layer_number) - 1  # Megatron's layer_number is global and 1-based
    return 0


def apply_multi_lora(
    model: nn.Module,
    target_modules: str | Sequence[str] = "all-linear",
    num_slots: int = 8,
    max_rank: int = 16,
    kernels: str = "auto",
    shared_expert_a: bool = False,
    expert_routing: str = "slot_major",
    expert_rank_scaling: bool = False,
) -> list[MultiLoRALinear]:
    """Replace the targeted linear layers with :class:`MultiLoRALinear` and freeze every base param.

    ``target_modules``: ``"all-linear"`` (qkv, proj, fc1, fc2) or a list of those names, plus
    ``"output_layer"`` to adapt the LM head. ``kernels``: see :class:`MultiLoRALinear`.
    In a mixture-of-experts layer fc1/fc2 are the experts' (one
    :class:`~miles_multilora.lora.expert_layer.MultiLoRAExpertLinear` each for all local experts,
    :mod:`~miles_multilora.lora.moe`) and the shared expert's (dense layers); ``shared_expert_a``:
    fc1's A shared by the experts; ``expert_routing``: ``slot_major`` or ``expert_major``;
    ``expert_rank_scaling``: a fresh slot's routed experts get rank ``rank / moe_router_topk``
    (:func:`~miles_multilora.lora.slots.init_slot`). The router is never a target.
    Every target is checked before the model changes: on error the model is exactly as before.
    Returns the new layers in module order.
    """
    from miles_multilora.lora.expert_routing import check_order
    from miles_multilora.lora.moe import inject_moe, validate_moe

    check_kernels(kernels)
    check_order(expert_routing)
    targets = _resolve_targets(target_modules)
    if any(isinstance(m, MultiLoRALinear) for m in model.modules()):
        raise ConfigError("model", "already has MultiLoRA layers (apply_multi_lora was called twice)")
    offset = _layer_offset(model)
    moes = validate_moe(model, shared_expert_a)
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if name.rsplit(".", 1)[-1] in targets and ".experts." not in f".{name}."
    ]
    experts_targeted = bool(moes) and any(t in targets for t in ("linear_fc1", "linear_fc2"))
    if not found and not experts_targeted:
        raise ConfigError("target_modules", f"none of {targets} exist in {type(model).__name__}")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:  # building a layer validates its base (type, own weight, TP settings) and freezes that base
        layers = [
            MultiLoRALinear(base, num_slots, max_rank, key=_stable_key(name, base, offset), kernels=kernels)
            for name, base in found
        ]
    except BaseException:
        for p, flag in flags:
            p.requires_grad_(flag)
        raise
    for p in model.parameters():
        p.requires_grad_(False)
    for (name, _), layer in zip(found, layers, strict=True):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, layer)
    inject_moe(
        model, targets, num_slots, max_rank, kernels, shared_expert_a, expert_routing, expert_rank_scaling
    )
    _layers_of.pop(model, None)
    return multi_lora_layers(model)


_layers_of: WeakKeyDictionary[nn.Module, list[MultiLoRALinear]] = WeakKeyDictionary()


def multi_lora_layers(model: nn.Module) -> list[MultiLoRALinear]:
    """The model's MultiLoRA layers in module order (raises if there are none). The walk over the
    model's modules (~5 ms for a 28-layer model on a CPU, and every forward routes its tokens
    through this) is done once per model; :func:`apply_multi_lora` renews it."""
    layers = _layers_of.get(model)
    if layers is None:
        layers = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
        if not layers:
            raise ConfigError("model", "has no MultiLoRA layers: call apply_multi_lora(model, ...) first")
        _layers_of[model] = layers
    return list(layers)


def use_fp8_base(model: nn.Module) -> int:
    """``model.base_precision=fp8``: every MultiLoRA layer's base GEMMs run on FP8 copies of its
    frozen weight (:mod:`~miles_multilora.lora.fp8_base`); returns the copies' bytes."""
    layers = multi_lora_layers(model)
    device = layers[0].base.weight.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            "model.base_precision", f"fp8 needs a GPU with FP8 tensor cores (Ada or Hopper); {name} has none"
        )
    for layer in layers:
        layer.set_fp8_base(True)
    return sum(layer.fp8.nbytes for layer in layers if layer.fp8 is not None)


def set_token_slots(model: nn.Module, slot_ids: torch.Tensor | RoutingPlan | None) -> RoutingPlan | None:
    """Route the next forward's tokens: ``slot_ids`` ``[batch, seq]``, or a plan built already
    (:func:`~miles_multilora.lora.routing.row_routing_plan`); ``None`` clears the routing."""
    layers = multi_lora_layers(model)
    if slot_ids is None:
        for layer in layers:
            layer.routing = None
        return None
    num_slots = model_num_slots(model)
    if isinstance(slot_ids, RoutingPlan):
        if slot_ids.num_slots != num_slots:
            raise ConfigError("routing", f"the plan has {slot_ids.num_slots} slots, the model {num_slots}")
        plan = slot_ids
    else:
        plan = build_routing_plan(slot_ids, num_slots)
    for layer in layers:
        layer.routing = plan
    return plan


def model_num_slots(model: nn.Module) -> int:
    """The slot count every MultiLoRA layer of ``model`` has."""
    num_slots = {layer.num_slots for layer in multi_lora_layers(model)}
    if len(num_slots) != 1:
        raise ConfigError("model", f"MultiLoRA layers disagree on num_slots: {sorted(num_slots)}")
    return num_slots.pop()


@contextmanager
def token_slots(model: nn.Module, slot_ids: torch.Tensor | RoutingPlan) -> Iterator[RoutingPlan]:
    """Context manager form of :func:`set_token_slots`; restores the previous routing on exit."""
    layers = multi_lora_layers(model)
    previous = [layer.routing for layer in layers]
    plan = set_token_slots(model, slot_ids)
    try:
        assert plan is not None
        yield plan
    finally:
        for layer, prev in zip(layers, previous, strict=True):
            layer.routing = prev
