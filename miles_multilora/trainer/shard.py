"""One slot's saved state, one file per TP rank: the format of RL checkpoints and Tinker saved states.

``<dir>/slot_rank{r}.pt`` holds TP rank ``r``'s exact slot tensors (``"slot"``, see
:func:`~miles_multilora.lora.slots.slot_state`), its optimizer state (``"optimizer"``) and the slot's
:class:`SlotMeta` (``"meta"``: its owner's name, LoRA rank, alpha, seed and weight version). Written
atomically (a ``.part`` file renamed into place) and read with ``torch.load(weights_only=True)``:
tensors and plain values only. Shards written before ``meta`` existed (RL checkpoints) have none.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class SlotMeta:
    """What a saved slot was: its owner's name, LoRA rank, alpha, init seed and weight version."""

    name: str
    rank: int
    alpha: float
    seed: int
    version: int


def shard_path(directory: str | Path, tp_rank: int) -> Path:
    return Path(directory) / f"slot_rank{tp_rank}.pt"


def write_shard(
    directory: str | Path, tp_rank: int, slot: dict[str, torch.Tensor], optimizer: dict, meta: SlotMeta
) -> Path:
    """Write TP rank ``tp_rank``'s shard into ``directory`` (created), atomically."""
    path = shard_path(directory, tp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    torch.save({"slot": slot, "optimizer": optimizer, "meta": asdict(meta)}, tmp)
    os.replace(tmp, path)
    return path


def read_shard(directory: str | Path, tp_rank: int) -> dict[str, Any]:
    """TP rank ``tp_rank``'s shard: ``{"slot", "optimizer"}`` and ``"meta"`` (a dict) when written."""
    return torch.load(shard_path(directory, tp_rank), weights_only=True)


def shard_meta(shard: dict[str, Any]) -> SlotMeta | None:
    """The :class:`SlotMeta` of a read shard (None for a shard written before it existed)."""
    meta = shard.get("meta")
    if meta is None:
        return None
    return SlotMeta(
        str(meta["name"]), int(meta["rank"]), float(meta["alpha"]), int(meta["seed"]), int(meta["version"])
    )
