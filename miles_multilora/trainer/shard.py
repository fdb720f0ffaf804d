"""One slot's saved state, one file per TP rank: the format of RL checkpoints and Tinker saved states.

``<dir>/slot_rank{r}.pt`` holds TP rank ``r``'s exact slot tensors (``"slot"``, see
:func:`~miles_multilora.lora.slots.slot_state`), its optimizer state (``"optimizer"``) and the slot's
:class:`SlotMeta` (``"meta"``: its owner's name, LoRA rank, alpha, seed and weight version). Written
atomically (a ``.part`` file renamed into place) and read with ``torch.load(weights_only=True)``:
tensors and plain values only. Shards written before ``meta`` existed (RL checkpoints) have none.

A shard keeps each layer's A and B (and their optimizer moments and fp32 masters) at the layer's
own LoRA rank, not the slot's ``max_rank`` (:func:`trim_to_rank`); loading pads them back with
zeros (:func:`pad_optimizer`), which is what the slot holds beyond its rank.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from miles_multilora.private_files import private_open


@dataclass(frozen=True)
class SlotMeta:
    """What a saved slot was: its owner's name, LoRA rank, alpha, init seed, weight version and the
    module families it trains (``targets``; None in shards written before slots had targets)."""

    name: str
    rank: int
    alpha: float
    seed: int
    version: int
    targets: tuple[str, ...] | None = None


def _rank_dim(name: str) -> int | None:
    """The LoRA-rank dimension of a slot tensor named ``<layer>.lora_A`` / ``<layer>.lora_B``."""
    if name.endswith(".lora_A"):
        return -2
    if name.endswith(".lora_B"):
        return -1
    return None


def _trim(tensors: dict[str, torch.Tensor], ranks: dict[str, int], copy: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        dim, layer = _rank_dim(name), name.rsplit(".", 1)[0]
        if dim is not None and layer in ranks:
            t = t.narrow(dim, 0, ranks[layer])
            out[name] = t.clone() if copy else t
        else:
            out[name] = t
    return out


def trim_to_rank(
    slot: dict[str, torch.Tensor], optimizer: dict, copy: bool = True
) -> tuple[dict[str, torch.Tensor], dict]:
    """``slot`` tensors and ``optimizer`` state cut to each layer's own rank (``<layer>.rank``);
    ``copy=False``: the cut tensors are views (the caller copies them)."""
    ranks = {name[: -len(".rank")]: int(t) for name, t in slot.items() if name.endswith(".rank")}
    optimizer = {
        k: (_trim(v, ranks, copy) if k in ("exp_avg", "exp_avg_sq", "master") else v)
        for k, v in optimizer.items()
    }
    return _trim(slot, ranks, copy), optimizer


def pad_optimizer(optimizer: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """``optimizer`` state whose rank-cut tensors are zero-padded to ``shapes`` (name -> full shape)."""

    def pad(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            full = shapes.get(name)
            if full is None or tuple(t.shape) == tuple(full) or len(full) != t.dim():
                out[name] = t
                continue
            padded = t.new_zeros(full)
            padded[tuple(slice(0, n) for n in t.shape)] = t
            out[name] = padded
        return out

    return {k: (pad(v) if k in ("exp_avg", "exp_avg_sq", "master") else v) for k, v in optimizer.items()}


def shard_path(directory: str | Path, tp_rank: int) -> Path:
    return Path(directory) / f"slot_rank{tp_rank}.pt"


def write_shard(
    directory: str | Path, tp_rank: int, slot: dict[str, torch.Tensor], optimizer: dict, meta: SlotMeta
) -> Path:
    """Write TP rank ``tp_rank``'s shard into ``directory`` (created), atomically."""
    path = shard_path(directory, tp_rank)
    tmp = path.with_name(f".{path.name}.part")
    with private_open(tmp, "wb") as f:  # 0600, its directories 0700
        torch.save({"slot": slot, "optimizer": optimizer, "meta": meta_dict(meta)}, f)
    os.replace(tmp, path)
    return path


def meta_dict(meta: SlotMeta) -> dict[str, Any]:
    """``meta`` as plain values (``targets`` a list) for ``torch.save``."""
    out = asdict(meta)
    if meta.targets is not None:
        out["targets"] = list(meta.targets)
    return out


def read_shard(directory: str | Path, tp_rank: int) -> dict[str, Any]:
    """TP rank ``tp_rank``'s shard: ``{"slot", "optimizer"}`` and ``"meta"`` (a dict) when written."""
    return torch.load(shard_path(directory, tp_rank), weights_only=True)


def shard_meta(shard: dict[str, Any]) -> SlotMeta | None:
    """The :class:`SlotMeta` of a read shard (None for a shard written before it existed)."""
    meta = shard.get("meta")
    if meta is None:
        return None
    targets = meta.get("targets")
    return SlotMeta(
        str(meta["name"]), int(meta["rank"]), float(meta["alpha"]), int(meta["seed"]), int(meta["version"]),
        None if targets is None else tuple(str(t) for t in targets),
    )  # fmt: skip
