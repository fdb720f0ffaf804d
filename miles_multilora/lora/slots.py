"""Slot lifecycle: init, clear, export to a PEFT adapter dir, load from one.

Every op validates first and changes no state on error. ``init_slot`` is deterministic and the
same on every DP replica and TP rank: it draws the full unsharded ``A`` from a CPU generator
seeded by ``(seed, layer key)`` and keeps this rank's shard.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.lora import expert_slots, layout
from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.lora.peft_format import (
    ADAPTER_WEIGHTS,
    hf_model_name,
    module_rank_alpha,
    parse_weight_key,
    peft_form,
    read_adapter_config,
    write_adapter,
)
from miles_multilora.lora.peft_parts import PartShape, SlotShape, fuse_parts, peft_scale
from miles_multilora.lora.targets import check_targets, family_of, held_families


def _check_slot(layers: list[MultiLoRALinear], slot: int) -> None:
    n = layers[0].num_slots
    if not isinstance(slot, int) or not 0 <= slot < n:
        raise ConfigError("slot", f"must be an int in 0..{n - 1}, got {slot!r}")


def _layer_generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _shapes(layer: MultiLoRALinear) -> list[SlotShape | None]:
    """The layer's per-slot :class:`SlotShape` list (kept on the layer, set by the slot ops here)."""
    shapes = getattr(layer, "peft_slot_shapes", None)
    if shapes is None:
        shapes = [None] * layer.num_slots
        setattr(layer, "peft_slot_shapes", shapes)  # noqa: B010 - an attribute MultiLoRALinear does not declare
    return shapes


def _layer_shape(layer: MultiLoRALinear, slot: int) -> SlotShape:
    """The slot's shape in a non-empty layer; without a record (old checkpoint): every part at the layer's rank."""
    shape = _shapes(layer)[slot]
    if shape is None:
        rank = layer.slot_rank[slot]
        shape = SlotShape.uniform(len(layout.hf_parts(layer)), rank, layer.slot_scale[slot] * rank)
    return shape


@torch.no_grad()
def _write_slot(
    layer: MultiLoRALinear,
    slot: int,
    a_local: torch.Tensor,
    b_local: torch.Tensor,
    scale: float,
    shape: SlotShape | None,
) -> None:
    rank = a_local.shape[-2]  # [rank, in], or [experts, rank, in] for an expert layer
    layer.lora_A[slot].zero_()
    layer.lora_B[slot].zero_()
    layer.lora_A[slot][..., :rank, :].copy_(a_local)
    layer.lora_B[slot][..., :rank].copy_(b_local)
    for p in (layer.lora_A, layer.lora_B):
        if p.grad is not None:
            p.grad[slot].zero_()
    layer.set_slot_scale(slot, rank, scale if rank else 0.0)
    _shapes(layer)[slot] = shape if rank else None


def _empty_slot(layer: MultiLoRALinear, slot: int) -> None:
    """Zero the slot's weights and grads and set its rank and scale to 0."""
    _write_slot(
        layer,
        slot,
        layer.lora_A.new_zeros(0, layer.in_features),
        layer.lora_B.new_zeros(layer.out_features, 0),
        0.0,
        None,
    )


def check_slot_args(
    model: nn.Module, slot: int, rank: int, alpha: float, targets: Sequence[str] | None = None
) -> list[MultiLoRALinear]:
    """The model's LoRA layers, once ``slot``, ``rank``, ``alpha`` and ``targets`` (families,
    :mod:`~miles_multilora.lora.targets`) are known to fit them."""
    layers = multi_lora_layers(model)
    if targets is not None:
        check_targets(targets)
    _check_slot(layers, slot)
    max_rank = layers[0].max_rank
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise SpecError("rank", f"must be an int in 1..{max_rank} (the model's max_rank), got {rank!r}")
    if not alpha > 0:
        raise SpecError("alpha", f"must be > 0, got {alpha!r}")
    trained = [la for la in layers if targets is None or family_of(la.key) in targets]
    divisors = {getattr(layer, "rank_divisor", 1) for layer in trained} - {1}
    if divisors and rank % (k := max(divisors)):
        raise SpecError(
            "rank",
            f"lora.expert_rank_scaling gives the routed experts rank {rank} / {k} (moe_router_topk): "
            f"the rank must be a multiple of {k}, got {rank}",
        )
    return layers


def layer_rank(layer: MultiLoRALinear, rank: int) -> int:
    """A fresh slot's rank in ``layer``: the adapter's, or its share in a routed expert layer with
    ``lora.expert_rank_scaling`` (``rank / moe_router_topk``; the alpha stays, so the scale grows)."""
    return rank // getattr(layer, "rank_divisor", 1)


def init_slot(
    model: nn.Module,
    slot: int,
    rank: int,
    alpha: float,
    seed: int,
    optimizer: Any = None,
    targets: Sequence[str] | None = None,
) -> None:
    """Fresh adapter in ``slot``: ``A`` kaiming-uniform (as PEFT), ``B = 0``, scale ``alpha / rank`` (fp32).

    ``targets``: the families it trains (None: all); in the layers of the others the slot is empty
    (rank 0, scale 0, zero ``A`` and ``B``), so it adds nothing there and nothing there moves. Each
    layer's ``A`` is drawn from ``(seed, layer key)``, whatever the targets. Routed expert layers
    get :func:`layer_rank` (scale ``alpha / their rank``)."""
    layers = check_slot_args(model, slot, rank, alpha, targets)
    for layer in layers:
        if targets is not None and family_of(layer.key) not in targets:
            _empty_slot(layer, slot)
            continue
        if isinstance(layer, MultiLoRAExpertLinear):
            r = layer_rank(layer, rank)
            a_experts = expert_slots.init_a(layer, r, seed).to(layer.lora_A.dtype)
            b_experts = torch.zeros(layer.num_local_experts, layer.out_features, r, dtype=layer.lora_B.dtype)
            shape = SlotShape.uniform(len(expert_slots.part_rows(layer)), r, alpha)
            _write_slot(layer, slot, a_experts, b_experts, float(alpha) / r, shape)
            continue
        bound = 1.0 / math.sqrt(layer.full_in_features)  # kaiming_uniform_(a=sqrt(5)), as PEFT/nn.Linear
        a_full = torch.empty(rank, layer.full_in_features, dtype=torch.float32)
        a_full.uniform_(-bound, bound, generator=_layer_generator(seed, layer.key))
        a_local = layout.shard_A(layer, a_full).to(layer.lora_A.dtype)
        b_local = torch.zeros(layer.out_features, rank, dtype=layer.lora_B.dtype)
        shape = SlotShape.uniform(len(layout.hf_parts(layer)), rank, alpha)
        _write_slot(layer, slot, a_local, b_local, float(alpha) / rank, shape)
    if optimizer is not None:
        optimizer.reset_slot(slot)


def clear_slot(model: nn.Module, slot: int, optimizer: Any = None) -> None:
    """Erase everything of the slot's owner: weights, grads, rank/scale, optimizer moments and step."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    for layer in layers:
        _empty_slot(layer, slot)
    if optimizer is not None:
        optimizer.reset_slot(slot)


def slot_targets(model: nn.Module, slot: int) -> tuple[str, ...]:
    """The families in which ``slot`` holds a LoRA (empty for an empty slot)."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    return held_families({layer.key: layer.slot_rank[slot] for layer in layers})


def slot_rank(model: nn.Module, slot: int) -> int:
    """The slot's rank as a PEFT adapter would state it (max over layers; 0 = empty slot)."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    return max(layer.slot_rank[slot] for layer in layers)


# ----- checkpoint state -----
def slot_state(model: nn.Module, slot: int, views: bool = False) -> dict[str, torch.Tensor]:
    """This rank's exact tensors of ``slot`` (A/B shards, rank, scale and PEFT shape of every layer);
    ``views``: A and B as views of the live slot (no copy; the caller copies them before the slot
    changes), else copies on the CPU."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    out: dict[str, torch.Tensor] = {}

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if views else t.detach().cpu().clone()

    for layer in layers:
        out[f"{layer.key}.lora_A"] = take(layer.lora_A[slot])
        out[f"{layer.key}.lora_B"] = take(layer.lora_B[slot])
        out[f"{layer.key}.rank"] = torch.tensor(int(layer.slot_rank[slot]))
        out[f"{layer.key}.scale"] = torch.tensor(float(layer.slot_scale[slot]), dtype=torch.float64)
        shape = _shapes(layer)[slot]
        if shape is not None:
            out[f"{layer.key}.peft_parts"], out[f"{layer.key}.peft_rslora"] = shape.to_tensors()
    return out


@torch.no_grad()
def load_slot_state(model: nn.Module, slot: int, state: dict[str, torch.Tensor]) -> None:
    """Put back tensors saved by :func:`slot_state` (same TP size) into ``slot``, exactly.

    Checkpoints written before slots recorded their PEFT shape export every module at its layer's rank.
    """
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    for layer in layers:
        rank = int(state[f"{layer.key}.rank"])
        a = state[f"{layer.key}.lora_A"][..., :rank, :].to(layer.lora_A.dtype)
        b = state[f"{layer.key}.lora_B"][..., :rank].to(layer.lora_B.dtype)
        parts = state.get(f"{layer.key}.peft_parts")
        shape = None if parts is None else SlotShape.from_tensors(parts, state[f"{layer.key}.peft_rslora"])
        _write_slot(layer, slot, a, b, float(state[f"{layer.key}.scale"]), shape)


# ----- export -----
def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def _export_layer(
    layer: MultiLoRALinear, slot: int, rslora: bool
) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """``(HF name, A, B, alpha)`` of every module the layer's slot holds, each at its own rank.

    A module keeps its recorded columns unless training wrote its ``B`` outside them (fused layers share
    one ``B`` across q/k/v or gate/up): then it takes the smallest column range that holds every non-zero
    column, so the export stays exact. Collective over TP (every TP rank must call it).
    """
    rank = layer.slot_rank[slot]
    a_full = layout.gather_A(layer, layer.lora_A[slot, :rank].detach()).cpu()
    b_full = layout.gather_B(layer, layer.lora_B[slot, :, :rank].detach()).cpu()
    shape, layer_scale = _layer_shape(layer, slot), layer.slot_scale[slot]
    out = []
    parts = zip(layout.hf_parts(layer), layout.split_rows(layer, b_full), shape.parts, strict=True)
    for name, b_part, part in parts:
        cols = b_part.ne(0).any(dim=0).nonzero().flatten().tolist()
        if part is not None:
            cols += [part.start, part.end - 1]
        if not cols:  # a module the adapter does not hold, and training never reached
            continue
        start, end = min(cols), max(cols) + 1
        scale = peft_scale(part.alpha, part.rank, shape.rslora) if part else layer_scale
        if part is not None and (start, end) == (part.start, part.end) and shape.rslora == rslora:
            alpha = part.alpha
        else:
            alpha = scale * (math.sqrt(end - start) if rslora else end - start)
        b = b_part[:, start:end]
        if scale != layer_scale:  # stored B is scaled to the layer's one scale: undo it
            b = (b.double() * (layer_scale / scale)).to(b.dtype)
        out.append((name, a_full[start:end].contiguous().clone(), b.contiguous().clone(), alpha))
    return out


def export_slot(
    model: nn.Module, slot: int, out_dir: str | Path, hf_config: Any = None, write: bool | None = None
) -> Path:
    """Write the slot as a PEFT adapter dir (``adapter_model.safetensors`` + ``adapter_config.json``).

    HF module names; fused qkv/fc1 split into the q/k/v and gate/up modules the slot holds; each module
    at its own rank and alpha (``rank_pattern``/``alpha_pattern``), only the layers it holds
    (``layers_to_transform`` or module names), rsLoRA kept. Gathered across TP (every TP rank must call
    this; only global rank 0 writes unless ``write``).
    """
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    held = [layer for layer in layers if layer.slot_rank[slot]]
    if not held:
        raise ConfigError("slot", f"slot {slot} is empty (init_slot or load_slot it first)")
    rslora = any(shape.rslora for shape in (_shapes(layer)[slot] for layer in held) if shape is not None)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, tuple[int, float]] = {}
    for layer in held:
        export = expert_slots.export_layer if isinstance(layer, MultiLoRAExpertLinear) else _export_layer
        for name, a, b, alpha in export(layer, slot, rslora):
            name = expert_slots.hf_name(name, hf_config)
            tensors[f"{layout.HF_PREFIX}{name}.lora_A.weight"] = a
            tensors[f"{layout.HF_PREFIX}{name}.lora_B.weight"] = b
            modules[name] = (a.shape[0], alpha)
    out_dir = Path(out_dir)
    if write if write is not None else _is_writer():
        all_names = [
            expert_slots.hf_name(name, hf_config) for layer in layers for name in _module_names(layer)
        ]
        write_adapter(out_dir, tensors, peft_form(modules, all_names, rslora), hf_model_name(hf_config))
    return out_dir


def _module_names(layer: MultiLoRALinear) -> list[str]:
    """Every HF module (canonical names) whose LoRA the layer holds: an expert layer's of all EP ranks."""
    if isinstance(layer, MultiLoRAExpertLinear):
        return expert_slots.all_module_names(layer)
    return layout.hf_parts(layer)


# ----- load -----
def _fuse_layer(
    layer: MultiLoRALinear,
    found: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, tuple[int, float]],
    rslora: bool,
) -> tuple[torch.Tensor, torch.Tensor, float, SlotShape]:
    """Full ``A`` [rank, in], canonical ``B`` [out, rank], the layer's scale and the slot's shape, exact
    (:func:`~miles_multilora.lora.peft_parts.fuse_parts` over the layer's HF modules)."""
    a_full, blocks, scale, shape = fuse_parts(
        layer.key, layout.hf_parts(layer), layout.part_rows(layer), layer.full_in_features, layer.max_rank,
        found, modules, rslora,
    )  # fmt: skip
    return a_full, layout.join_rows(layer, blocks), scale, shape


def _fuse(
    layer: MultiLoRALinear,
    found: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, tuple[int, float]],
    rslora: bool,
) -> tuple[torch.Tensor, torch.Tensor, float, SlotShape]:
    if not isinstance(layer, MultiLoRAExpertLinear):
        return _fuse_layer(layer, found, modules, rslora)
    a, b, scale = expert_slots.fuse_layer(layer, found, modules, rslora)
    rank = a.shape[-2]
    alpha = scale * (math.sqrt(rank) if rslora else rank)
    parts = len(expert_slots.part_rows(layer))
    return a, b, scale, SlotShape((PartShape(0, rank, alpha),) * parts, rslora)


def load_slot(model: nn.Module, slot: int, adapter_dir: str | Path, optimizer: Any = None) -> None:
    """Load a PEFT LoRA adapter dir into ``slot`` (strict names and shapes; exact scales).

    The slot remembers the adapter's shape (modules, per-module rank and alpha, rsLoRA), so
    :func:`export_slot` writes the same adapter back. PEFT features a slot cannot represent (DoRA,
    biases, embedding LoRA, saved base weights, ...) are refused by name.
    """
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir)
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    owner = {name: layer for layer in layers for name in _module_names(layer)}
    found: dict[MultiLoRALinear, dict[str, dict[str, torch.Tensor]]] = {}
    file_name: dict[str, str] = {}  # canonical -> as in the adapter (its rank/alpha patterns match that)
    for key, tensor in weights.items():
        named, which = parse_weight_key(key)
        module = expert_slots.canonical_name(named)
        file_name[module] = named
        if module not in owner:
            raise SpecError(key, f"module {named!r} is not a MultiLoRA target of this model")
        found.setdefault(owner[module], {}).setdefault(module, {})[which] = tensor.float()
    for parts in found.values():
        for module, pair in parts.items():
            if set(pair) != {"A", "B"}:
                missing = "B" if "A" in pair else "A"
                raise SpecError(
                    f"{layout.HF_PREFIX}{module}.lora_{missing}.weight",
                    "missing (lora_A and lora_B come in pairs)",
                )
    if not found:
        raise SpecError(str(adapter_dir), "the adapter has no LoRA weights")
    rslora = bool(cfg.get("use_rslora"))
    plan = {  # validate every layer before writing any
        layer: _fuse(layer, parts, {n: module_rank_alpha(cfg, file_name[n]) for n in parts}, rslora)
        for layer, parts in found.items()
    }
    for layer in layers:
        if layer in plan and isinstance(layer, MultiLoRAExpertLinear):
            a_experts, b_experts, scale, shape = plan[layer]
            a_experts, b_experts = a_experts.to(layer.lora_A.dtype), b_experts.to(layer.lora_B.dtype)
            _write_slot(layer, slot, a_experts, b_experts, scale, shape)
        elif layer in plan:
            a_full, b_full, scale, shape = plan[layer]
            a_local = layout.shard_A(layer, a_full).to(layer.lora_A.dtype)
            b_local = layout.shard_B(layer, b_full).to(layer.lora_B.dtype)
            _write_slot(layer, slot, a_local, b_local, scale, shape)
        else:
            _empty_slot(layer, slot)
    if optimizer is not None:
        optimizer.reset_slot(slot)
