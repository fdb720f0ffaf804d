"""A slot's PEFT shape (which HF modules it holds, at which columns and alphas) and the fusing of
PEFT modules into one layer's ``A``/``B``: plain tensors, no model (used by :mod:`~miles_multilora.lora.slots`
for fused Megatron layers and by :mod:`~miles_multilora.lora.expert_slots` for each expert)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miles_multilora.errors import SpecError
from miles_multilora.lora.layout import HF_PREFIX
from miles_multilora.lora.peft_format import leaf_name


def peft_scale(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


@dataclass(frozen=True)
class PartShape:
    """One HF module a layer's slot holds: its columns ``[start, end)`` of the slot's ``A`` rows
    (= ``B`` columns) and its PEFT alpha. Its ``B`` rows are stored times ``scale / layer scale``."""

    start: int
    end: int
    alpha: float

    @property
    def rank(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SlotShape:
    """What a layer's slot holds as a PEFT adapter: one :class:`PartShape` (``None``: not held) per
    entry of :func:`layout.hf_parts`, and whether the adapter is rsLoRA."""

    parts: tuple[PartShape | None, ...]
    rslora: bool = False

    @classmethod
    def uniform(cls, n_parts: int, rank: int, alpha: float) -> SlotShape:
        """Every part at columns ``[0, rank)`` with one alpha (``init_slot``, old checkpoints)."""
        return cls((PartShape(0, rank, float(alpha)),) * n_parts)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain tensors for checkpoints: ``[n_parts, 3]`` (start, end, alpha; end = start: not held), rslora."""
        rows = [(p.start, p.end, p.alpha) if p else (0, 0, 0.0) for p in self.parts]
        return torch.tensor(rows, dtype=torch.float64), torch.tensor(self.rslora)

    @classmethod
    def from_tensors(cls, parts: torch.Tensor, rslora: torch.Tensor) -> SlotShape:
        rows = [(int(s), int(e), float(a)) for s, e, a in parts.tolist()]
        return cls(tuple(PartShape(s, e, a) if e > s else None for s, e, a in rows), bool(rslora))


def fuse_parts(
    key: str,
    names: list[str],
    rows: list[int],
    in_features: int,
    max_rank: int,
    found: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, tuple[int, float]],
    rslora: bool,
) -> tuple[torch.Tensor, list[torch.Tensor], float, SlotShape]:
    """One fused layer's HF modules ``names`` (``rows`` output rows each) from PEFT tensors ``found``
    (name -> ``A``/``B``) and ``modules`` (name -> rank, alpha): the full ``A`` [rank, in], one ``B``
    block [rows, rank] per name, the layer's scale and the slot's shape, exact.

    Parts sharing one ``A`` (what :func:`export_slot` writes for a fresh slot) keep rank r; distinct
    ``A``s (what PEFT makes) are stacked with a block-diagonal ``B``. A part whose scale differs from
    the layer's (first part's) has its ``B`` block scaled by the ratio.
    """
    present = [n for n in names if n in found]
    for name, n_rows in zip(names, rows, strict=True):
        if name not in found:
            continue
        a, b = found[name]["A"], found[name]["B"]
        where = f"{HF_PREFIX}{name}"
        if a.dim() != 2 or a.shape[1] != in_features:
            raise SpecError(f"{where}.lora_A.weight", f"shape {tuple(a.shape)}, expected [r, {in_features}]")
        if b.dim() != 2 or b.shape != (n_rows, a.shape[0]):
            raise SpecError(
                f"{where}.lora_B.weight", f"shape {tuple(b.shape)}, expected [{n_rows}, {a.shape[0]}]"
            )
        if a.shape[0] != modules[name][0]:
            raise SpecError(
                f"{where}.lora_A.weight",
                f"rank {a.shape[0]}, but adapter_config.json gives this module r={modules[name][0]} "
                "(r / rank_pattern)",
            )
    first = found[present[0]]["A"]
    shared = all(found[n]["A"].shape == first.shape and torch.equal(found[n]["A"], first) for n in present)
    a_full = first if shared else torch.cat([found[n]["A"] for n in present], dim=0)
    if a_full.shape[0] > max_rank:
        parts = "+".join(leaf_name(n) for n in present)
        raise SpecError(
            "rank",
            f"{key}: {parts} have different lora_A matrices, so the fused layer needs rank "
            f"{a_full.shape[0]} > max_rank {max_rank}; raise max_rank to at least {a_full.shape[0]}",
        )
    scales = {n: peft_scale(modules[n][1], modules[n][0], rslora) for n in present}
    layer_scale = scales[present[0]]
    blocks, shape, col = [], [], 0
    for name, n_rows in zip(names, rows, strict=True):
        block = a_full.new_zeros(n_rows, a_full.shape[0])
        if name not in found:
            blocks.append(block)
            shape.append(None)
            continue
        r = found[name]["A"].shape[0]
        start = 0 if shared else col
        b = found[name]["B"]
        if scales[name] != layer_scale:
            b = (b.double() * (scales[name] / layer_scale)).to(b.dtype)
        block[:, start : start + r] = b
        blocks.append(block)
        shape.append(PartShape(start, start + r, modules[name][1]))
        col += r
    return a_full, blocks, layer_scale, SlotShape(tuple(shape), rslora)
