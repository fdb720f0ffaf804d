"""Slot lifecycle: init, clear, export to a PEFT adapter dir, load from one.

Every op validates first and changes no state on error. ``init_slot`` is deterministic and the
same on every DP replica and TP rank: it draws the full unsharded ``A`` from a CPU generator
seeded by ``(seed, layer key)`` and keeps this rank's shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.lora import layout
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.lora.layer import MultiLoRALinear

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _check_slot(layers: list[MultiLoRALinear], slot: int) -> None:
    n = layers[0].num_slots
    if not isinstance(slot, int) or not 0 <= slot < n:
        raise ConfigError("slot", f"must be an int in 0..{n - 1}, got {slot!r}")


def _layer_generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@torch.no_grad()
def _write_slot(
    layer: MultiLoRALinear, slot: int, a_local: torch.Tensor, b_local: torch.Tensor, scale: float
) -> None:
    rank = a_local.shape[0]
    layer.lora_A[slot].zero_()
    layer.lora_B[slot].zero_()
    layer.lora_A[slot, :rank].copy_(a_local)
    layer.lora_B[slot, :, :rank].copy_(b_local)
    for p in (layer.lora_A, layer.lora_B):
        if p.grad is not None:
            p.grad[slot].zero_()
    layer.set_slot_scale(slot, rank, scale if rank else 0.0)


def _empty_slot(layer: MultiLoRALinear, slot: int) -> None:
    """Zero the slot's weights and grads and set its rank and scale to 0."""
    _write_slot(
        layer,
        slot,
        layer.lora_A.new_zeros(0, layer.in_features),
        layer.lora_B.new_zeros(layer.out_features, 0),
        0.0,
    )


def init_slot(model: nn.Module, slot: int, rank: int, alpha: float, seed: int, optimizer: Any = None) -> None:
    """Fresh adapter in ``slot``: ``A`` kaiming-uniform (as PEFT), ``B = 0``, scale ``alpha / rank`` (fp32)."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    max_rank = layers[0].max_rank
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise SpecError("rank", f"must be an int in 1..{max_rank} (the model's max_rank), got {rank!r}")
    if not alpha > 0:
        raise SpecError("alpha", f"must be > 0, got {alpha!r}")
    for layer in layers:
        bound = 1.0 / math.sqrt(layer.full_in_features)  # kaiming_uniform_(a=sqrt(5)), as PEFT/nn.Linear
        a_full = torch.empty(rank, layer.full_in_features, dtype=torch.float32)
        a_full.uniform_(-bound, bound, generator=_layer_generator(seed, layer.key))
        a_local = layout.shard_A(layer, a_full).to(layer.lora_A.dtype)
        b_local = torch.zeros(layer.out_features, rank, dtype=layer.lora_B.dtype)
        _write_slot(layer, slot, a_local, b_local, float(alpha) / rank)
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


def slot_rank(model: nn.Module, slot: int) -> int:
    """The slot's rank as a PEFT adapter would state it (max over layers; 0 = empty slot)."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    return max(layer.slot_rank[slot] for layer in layers)


# ----- export -----
def slot_state(model: nn.Module, slot: int) -> dict[str, torch.Tensor]:
    """This rank's exact tensors of ``slot`` (A/B shards, rank and scale of every layer), for checkpoints."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        out[f"{layer.key}.lora_A"] = layer.lora_A[slot].detach().cpu().clone()
        out[f"{layer.key}.lora_B"] = layer.lora_B[slot].detach().cpu().clone()
        out[f"{layer.key}.rank"] = torch.tensor(int(layer.slot_rank[slot]))
        out[f"{layer.key}.scale"] = torch.tensor(float(layer.slot_scale[slot]), dtype=torch.float64)
    return out


@torch.no_grad()
def load_slot_state(model: nn.Module, slot: int, state: dict[str, torch.Tensor]) -> None:
    """Put back tensors saved by :func:`slot_state` (same TP size) into ``slot``, exactly."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    for layer in layers:
        rank = int(state[f"{layer.key}.rank"])
        a = state[f"{layer.key}.lora_A"][:rank].to(layer.lora_A.dtype)
        b = state[f"{layer.key}.lora_B"][:, :rank].to(layer.lora_B.dtype)
        _write_slot(layer, slot, a, b, float(state[f"{layer.key}.scale"]))


def _hf_name(hf_config: Any) -> str | None:
    if hf_config is None:
        return None
    if isinstance(hf_config, dict):
        return hf_config.get("_name_or_path")
    return getattr(hf_config, "_name_or_path", None)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def export_slot(
    model: nn.Module, slot: int, out_dir: str | Path, hf_config: Any = None, write: bool | None = None
) -> Path:
    """Write the slot as a PEFT adapter dir (``adapter_model.safetensors`` + ``adapter_config.json``).

    HF module names, fused qkv/fc1 split into q/k/v and gate/up, sliced to the slot's rank,
    gathered across TP (every TP rank must call this; only global rank 0 writes unless ``write``).
    """
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    rank = max(layer.slot_rank[slot] for layer in layers)
    if rank == 0:
        raise ConfigError("slot", f"slot {slot} is empty (init_slot or load_slot it first)")
    scales = {layer.slot_scale[slot] for layer in layers if layer.slot_rank[slot]}
    if len(scales) != 1:
        raise ConfigError(
            "slot", f"slot {slot} has different scales per layer {sorted(scales)}; cannot export one alpha"
        )
    scale = scales.pop()
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for layer in layers:
        with torch.no_grad():
            a_full = layout.gather_A(layer, layer.lora_A[slot, :rank].detach())
            b_full = layout.gather_B(layer, layer.lora_B[slot, :, :rank].detach())
        for name, b_part in zip(layout.hf_parts(layer), layout.split_rows(layer, b_full), strict=True):
            tensors[f"{layout.HF_PREFIX}{name}.lora_A.weight"] = a_full.cpu().contiguous().clone()
            tensors[f"{layout.HF_PREFIX}{name}.lora_B.weight"] = b_part.cpu().contiguous().clone()
            modules.add(name.rsplit(".", 1)[-1])
    out_dir = Path(out_dir)
    if write if write is not None else _is_writer():
        _write_adapter(out_dir, tensors, rank, scale * rank, sorted(modules), _hf_name(hf_config))
    return out_dir


def _write_adapter(
    out_dir: Path, tensors: dict, rank: int, alpha: float, modules: list[str], base: str | None
) -> None:
    from peft import LoraConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    tmp_weights = out_dir / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_config = out_dir / f".{ADAPTER_CONFIG}.tmp"
    data = config.to_dict()
    data = {k: (sorted(v) if isinstance(v, set) else v) for k, v in data.items()}
    tmp_config.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp_weights, out_dir / ADAPTER_WEIGHTS)
    os.replace(tmp_config, out_dir / ADAPTER_CONFIG)


# ----- load -----
def _read_adapter_config(adapter_dir: Path) -> tuple[float, dict]:
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise SpecError(
            str(adapter_dir), f"not a PEFT adapter dir: needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise SpecError("peft_type", f"only LORA adapters can be loaded, got {cfg.get('peft_type')!r}")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise SpecError(key, f"{key}={bad} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise SpecError("bias", "adapters that train biases are not supported (need bias='none')")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise SpecError(key, f"{key} is not supported (one rank and alpha for every module)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise SpecError(
            "r", f"adapter_config.json needs r >= 1 and lora_alpha > 0, got r={r!r}, lora_alpha={alpha!r}"
        )
    scale = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return scale, cfg


def _parse_key(key: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (``X``, ``A``)."""
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if key.startswith(layout.HF_PREFIX) and key.endswith(suffix):
            return key[len(layout.HF_PREFIX) : -len(suffix)], which
    raise SpecError(key, f"not a PEFT LoRA weight name ({layout.HF_PREFIX}<module>.lora_A/B.weight)")


def _fuse_layer(
    layer: MultiLoRALinear, found: dict[str, dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full ``A`` [rank, in] and canonical ``B`` [out, rank] for one layer, exact (block form if needed)."""
    names, rows = layout.hf_parts(layer), layout.part_rows(layer)
    present = [n for n in names if n in found]
    for name, n_rows in zip(names, rows, strict=True):
        if name not in found:
            continue
        a, b = found[name]["A"], found[name]["B"]
        key = f"{layout.HF_PREFIX}{name}"
        if a.dim() != 2 or a.shape[1] != layer.full_in_features:
            raise SpecError(
                f"{key}.lora_A.weight", f"shape {tuple(a.shape)}, expected [r, {layer.full_in_features}]"
            )
        if b.dim() != 2 or b.shape != (n_rows, a.shape[0]):
            raise SpecError(
                f"{key}.lora_B.weight", f"shape {tuple(b.shape)}, expected [{n_rows}, {a.shape[0]}]"
            )
    first = found[present[0]]["A"]
    shared = all(found[n]["A"].shape == first.shape and torch.equal(found[n]["A"], first) for n in present)
    if shared:  # one A for all parts (what export_slot writes): rank r
        a_full = first
        blocks = [
            found[n]["B"] if n in found else first.new_zeros(r, first.shape[0])
            for n, r in zip(names, rows, strict=True)
        ]
    else:  # distinct A per part (what peft makes): A stacked, B block-diagonal
        a_full = torch.cat([found[n]["A"] for n in present], dim=0)
        blocks, col = [], 0
        for name, n_rows in zip(names, rows, strict=True):
            block = a_full.new_zeros(n_rows, a_full.shape[0])
            if name in found:
                r = found[name]["A"].shape[0]
                block[:, col : col + r] = found[name]["B"]
                col += r
            blocks.append(block)
    if a_full.shape[0] > layer.max_rank:
        parts = "+".join(n.rsplit(".", 1)[-1] for n in present)
        raise SpecError(
            "rank",
            f"{layer.key}: {parts} have different lora_A matrices, so the fused layer needs rank "
            f"{a_full.shape[0]} > max_rank {layer.max_rank}; raise max_rank to at least {a_full.shape[0]}",
        )
    return a_full, layout.join_rows(layer, blocks)


def load_slot(model: nn.Module, slot: int, adapter_dir: str | Path, optimizer: Any = None) -> None:
    """Load a PEFT LoRA adapter dir into ``slot`` (strict names and shapes; exact scale)."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    adapter_dir = Path(adapter_dir)
    scale, _ = _read_adapter_config(adapter_dir)
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    owner = {name: layer for layer in layers for name in layout.hf_parts(layer)}
    found: dict[MultiLoRALinear, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in weights.items():
        module, which = _parse_key(key)
        if module not in owner:
            raise SpecError(key, f"module {module!r} is not a MultiLoRA target of this model")
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
    plan = {layer: _fuse_layer(layer, parts) for layer, parts in found.items()}  # validate all first
    for layer in layers:
        if layer in plan:
            a_full, b_full = plan[layer]
            a_local = layout.shard_A(layer, a_full).to(layer.lora_A.dtype)
            b_local = layout.shard_B(layer, b_full).to(layer.lora_B.dtype)
            _write_slot(layer, slot, a_local, b_local, scale)
        else:
            _empty_slot(layer, slot)
    if optimizer is not None:
        optimizer.reset_slot(slot)
