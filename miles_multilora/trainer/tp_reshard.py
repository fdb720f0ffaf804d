"""A slot state saved at one tensor-parallel size, loaded at another.

A saved state holds one shard per TP rank (:mod:`~miles_multilora.trainer.shard`). In it, each dense
LoRA layer's ``A`` of a row-parallel layer (split on its input columns) and ``B`` of a
column-parallel one (split on its output rows; a gated fc1's ``[gate; up]`` halves each split, as
:func:`~miles_multilora.lora.layout.shard_B` does) are that rank's part; everything else (ranks,
scales, a column layer's ``A``, a row layer's ``B``, the experts: whole on each TP rank) is the
same in every shard. A state saved at ``n`` TP ranks loads at ``m``: the saved parts are joined
into the full tensors and this rank's part is taken, the optimizer's moments and fp32 masters
alike, so the state is the one the ``n`` ranks held, exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_multilora.errors import SpecError
from miles_multilora.lora import MultiLoRAExpertLinear, layout, multi_lora_layers
from miles_multilora.lora.layer import COLUMN, ROW

MOMENTS = ("exp_avg", "exp_avg_sq", "master")  # the optimizer's per-tensor state, shaped as the slot's


@dataclass(frozen=True)
class TPSplit:
    """How a model's slot tensors split over its ``size`` TP ranks: ``dims`` maps the name of each
    split tensor to ``(dimension, gated)`` (``gated``: a fused ``[gate; up]``, each half split)."""

    size: int
    dims: Mapping[str, tuple[int, bool]]

    @classmethod
    def of(cls, model: torch.nn.Module, size: int) -> TPSplit:
        dims: dict[str, tuple[int, bool]] = {}
        for layer in multi_lora_layers(model):
            if isinstance(layer, MultiLoRAExpertLinear):  # whole on every TP rank
                continue
            if layer.kind == ROW:
                dims[f"{layer.key}.lora_A"] = (-1, False)
            elif layer.kind == COLUMN:
                dims[f"{layer.key}.lora_B"] = (-2, layout.fc1_gated(layer))
        return cls(size, dims)


def saved_tp_size(directory: str | Path) -> int:
    """The number of TP shards (``slot_rank{r}.pt``, r = 0, 1, ...) a state in ``directory`` has."""
    n = 0
    while (Path(directory) / f"slot_rank{n}.pt").is_file():
        n += 1
    return n


def _join(parts: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    if not gated:
        return torch.cat(parts, dim)
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)


def _part(full: torch.Tensor, dim: int, gated: bool, rank: int, size: int, name: str) -> torch.Tensor:
    blocks = full.chunk(2, dim) if gated else (full,)
    if any(b.shape[dim] % size for b in blocks):
        raise SpecError(
            "model.tp",
            f"the saved {name} of shape {tuple(full.shape)} does not split over {size} TP ranks: "
            "load it at a model.tp that divides it",
        )
    return torch.cat([b.chunk(size, dim)[rank] for b in blocks], dim).clone()


def resplit(shards: list[dict[str, Any]], split: TPSplit, tp_rank: int) -> dict[str, Any]:
    """TP rank ``tp_rank``'s shard (of ``split.size``) from every shard of a state saved at
    ``len(shards)`` TP ranks (``{"slot", "optimizer"}`` and ``"meta"``, as read)."""

    def take(tensors: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for name, first in tensors[0].items():
            if name not in split.dims:
                out[name] = first
                continue
            dim, gated = split.dims[name]
            full = _join([t[name] for t in tensors], dim, gated)
            out[name] = _part(full, dim, gated, tp_rank, split.size, name)
        return out

    base = shards[0]
    optimizer = dict(base["optimizer"])
    for key in MOMENTS:
        if key in optimizer:
            optimizer[key] = take([s["optimizer"][key] for s in shards])
    return dict(base, slot=take([s["slot"] for s in shards]), optimizer=optimizer)
