"""A parked slot written back as whole rows: one split and one multi-tensor copy per dtype.

The general restore (:mod:`~miles_multilora.trainer.slot_write`) takes a saved state as a tree of
~1,100 tensors, checks each, cuts it to the adapter's rank and pairs it with its slot row: ~20
tensor operations of host time per tensor, ~15 ms per rank-16 adapter of the 1.70 B benchmark shape
on an H200, where the copies themselves take 0.3 ms. When every tensor a park packed is a whole slot
row (the adapter at the slots' ``max_rank`` training every family, its fp32 masters kept), none of
that is needed: the park gathers the rows (:meth:`SlotRows.whole_rows`, views made once per slot)
and notes which rows its flat buffers hold, in buffer order, with the slot's Python-side settings
(:meth:`SlotRows.layout`); :meth:`SlotRows.write` splits each buffer into those rows and writes
them with one foreach copy per dtype into flat views of the slot's rows. The saved-state tree is
built from the buffers only when something reads it (:meth:`RowLayout.tree`). Bit for bit what the
general path writes and builds (``tests/unit/test_slot_write.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from miles_multilora.host_tensors import tensor_on
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.lora.peft_parts import SlotShape
from miles_multilora.lora.slots import _shapes
from miles_multilora.optim.slot_adamw import SlotAdamW
from miles_multilora.trainer.host_copies import HostPack, TreePath, host_views
from miles_multilora.trainer.shard import SlotMeta, meta_dict

if TYPE_CHECKING:
    from miles_multilora.config.adapter import OptimizerSpec


@dataclass(frozen=True)
class RowLayout:
    """What a park packed as whole rows: per dtype the tree paths in buffer order and their sizes;
    the slot's per-layer rank, scale and PEFT shape; its optimizer step, spec and horizon."""

    paths: dict[torch.dtype, list[TreePath]]
    sizes: dict[torch.dtype, list[int]]
    grads: frozenset[str]  # parameters whose gradient rows it holds (the others are zero)
    ranks: list[int]
    scales: list[float]
    shapes: list[SlotShape | None]
    step: int
    spec: OptimizerSpec | None
    total_steps: int | None
    keys: tuple[str, ...]  # the layers' keys, in order (to rebuild the saved-state tree)
    names: tuple[str, ...]  # the optimizer's parameter names, in order

    def tree(self, host: HostPack, meta: SlotMeta) -> dict[str, Any]:
        """The parked state as :func:`~miles_multilora.trainer.offload.park`'s general path builds it
        (``{"slot", "optimizer", "meta", "grads"}``, tensors as views of ``host``'s buffers): for a
        spill to disk and every reader of the tree."""
        views = host_views(host)
        slot: dict[str, torch.Tensor] = {}
        for key, rank, scale, shape in zip(self.keys, self.ranks, self.scales, self.shapes, strict=True):
            slot[f"{key}.lora_A"] = views[("slot", f"{key}.lora_A")]
            slot[f"{key}.lora_B"] = views[("slot", f"{key}.lora_B")]
            slot[f"{key}.rank"] = torch.tensor(rank)
            slot[f"{key}.scale"] = torch.tensor(scale, dtype=torch.float64)
            if shape is not None:
                slot[f"{key}.peft_parts"], slot[f"{key}.peft_rslora"] = shape.to_tensors()
        optimizer: dict[str, Any] = {
            "step": self.step,
            "optimizer": asdict(self.spec) if self.spec is not None else None,
            "total_steps": self.total_steps,
        }
        for part in ("exp_avg", "exp_avg_sq", "master"):
            found = {n: views[("optimizer", part, n)] for n in self.names if ("optimizer", part, n) in views}
            if found or part != "master":
                optimizer[part] = found
        grads = {n: views[("grads", n)] for n in self.names if n in self.grads}
        return {"slot": slot, "optimizer": optimizer, "meta": meta_dict(meta), "grads": grads}


@dataclass(frozen=True)
class PackedRows:
    """A parked state to restore as whole rows: its meta, its layout and its flat buffers, on the
    model's device (what :meth:`~miles_multilora.trainer.rank.TrainerRank.open_slot` takes as
    ``restore``)."""

    meta: SlotMeta
    layout: RowLayout
    buffers: dict[torch.dtype, torch.Tensor]


class SlotRows:
    """The slot rows of a model's MultiLoRA layers and their :class:`SlotAdamW` state, by the tree
    path a park gives them (``("slot", "<layer>.lora_A")``, ``("optimizer", "exp_avg", name)``,
    ``("grads", name)``, ...), with flat views of each slot's rows made once."""

    def __init__(self, model: torch.nn.Module, optimizer: SlotAdamW) -> None:
        self.layers = multi_lora_layers(model)
        self.optimizer = optimizer
        self._full: dict[TreePath, torch.Tensor] = {}  # [num_slots, ...] tensors
        for layer in self.layers:
            self._full[("slot", f"{layer.key}.lora_A")] = layer.lora_A
            self._full[("slot", f"{layer.key}.lora_B")] = layer.lora_B
        for i, name in enumerate(optimizer.names):
            self._full[("optimizer", "exp_avg", name)] = optimizer.exp_avg[i]
            self._full[("optimizer", "exp_avg_sq", name)] = optimizer.exp_avg_sq[i]
            if optimizer.master[i] is not None:
                self._full[("optimizer", "master", name)] = optimizer.master[i]
        self._param = {name: p for name, p in zip(optimizer.names, optimizer.params, strict=True)}
        self._row_shape = {path: t.shape[1:] for path, t in self._full.items()}
        self._row_shape.update({("grads", n): p.shape[1:] for n, p in self._param.items()})
        self._usable = all(t.is_contiguous() for t in self._full.values())
        self._views: dict[int, dict[TreePath, torch.Tensor]] = {}  # flat, per slot
        self._shaped: dict[int, dict[TreePath, torch.Tensor]] = {}  # as the saved-state tree has them
        self._grad_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def layout(self, slot: int, pack: HostPack) -> RowLayout | None:
        """``pack`` (a park of ``slot``, taken just now) as whole rows, or None when any tensor in
        it is not a whole row or a row the restore must write is missing from it."""
        if not self._usable:
            return None
        needed = set(self._full)
        paths: dict[torch.dtype, list[TreePath]] = {}
        sizes: dict[torch.dtype, list[int]] = {}
        for path, dtype, _, shape in pack.places:
            if self._row_shape.get(path) != shape:
                return None
            needed.discard(path)
            paths.setdefault(dtype, []).append(path)
            sizes.setdefault(dtype, []).append(shape.numel())
        if needed:
            return None
        opt = self.optimizer
        spec = opt.specs[slot]
        return RowLayout(
            paths, sizes, frozenset(p[1] for group in paths.values() for p in group if p[0] == "grads"),
            [int(layer.slot_rank[slot]) for layer in self.layers],
            [float(layer.slot_scale[slot]) for layer in self.layers],
            [_shapes(layer)[slot] for layer in self.layers],
            int(opt.steps[slot]), None if spec is None else replace(spec), opt.total_steps[slot],
            tuple(layer.key for layer in self.layers), tuple(opt.names),
        )  # fmt: skip

    def whole_rows(self, slot: int, max_rank: int) -> list[tuple[TreePath, torch.Tensor]] | None:
        """Every row of ``slot`` a park keeps, by path (views, in the order the saved-state tree has
        them), when the adapter holds every layer at ``max_rank`` (nothing to cut); else None. The
        gradient rows come along when any of them is not zero (one sync)."""
        if not self._usable or any(int(layer.slot_rank[slot]) != max_rank for layer in self.layers):
            return None
        shaped = self._shaped.get(slot)
        if shaped is None:
            shaped = self._shaped[slot] = {path: t[slot] for path, t in self._full.items()}
        items = list(shaped.items())
        with_grad = [n for n, p in self._param.items() if p.grad is not None]
        if with_grad and bool(torch.cat([self._grad_row(slot, n) for n in with_grad]).any()):
            items += [(("grads", n), self._param[n].grad[slot]) for n in with_grad]  # type: ignore[index]
        return items

    def _rows(self, slot: int) -> dict[TreePath, torch.Tensor]:
        views = self._views.get(slot)
        if views is None:
            views = {path: t[slot].view(-1) for path, t in self._full.items()}
            views.update({("scale", layer.key): layer.lora_scale[slot : slot + 1] for layer in self.layers})
            self._views[slot] = views
        return views

    def _grad_row(self, slot: int, name: str) -> torch.Tensor:
        """The flat view of ``name``'s gradient row, made again when the gradient was replaced."""
        grad = self._param[name].grad
        assert grad is not None
        held = self._grad_views.get((slot, name))
        if held is None or held[0] is not grad:
            held = self._grad_views[(slot, name)] = (grad, grad[slot].view(-1))
        return held[1]

    @torch.no_grad()
    def write(self, slot: int, layout: RowLayout, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        """Put the rows ``layout`` describes, held in ``buffers`` (flat, per dtype, on the model's
        device), into ``slot`` with its settings; gradient rows the park did not hold become zero."""
        rows = self._rows(slot)
        for name in layout.grads:
            if self._param[name].grad is None:
                self._param[name].grad = torch.zeros_like(self._param[name])
        zero = [
            self._grad_row(slot, n)
            for n, p in self._param.items()
            if p.grad is not None and n not in layout.grads
        ]
        if zero:
            torch._foreach_zero_(zero)
        for dtype, paths in layout.paths.items():
            dst = [self._grad_row(slot, p[1]) if p[0] == "grads" else rows[p] for p in paths]
            torch._foreach_copy_(dst, list(buffers[dtype].split(layout.sizes[dtype])))
        scale_rows = [rows[("scale", layer.key)] for layer in self.layers]
        # fp32, rounded once from the Python floats, as set_slot_scale does
        scales = tensor_on(layout.scales, scale_rows[0].device, torch.float32)
        torch._foreach_copy_(scale_rows, list(scales.split(1)))
        for layer, rank, scale, shape in zip(
            self.layers, layout.ranks, layout.scales, layout.shapes, strict=True
        ):
            layer.slot_rank[slot] = rank
            layer.slot_scale[slot] = scale
            _shapes(layer)[slot] = shape
        self.optimizer.steps[slot] = layout.step
        self.optimizer.specs[slot] = None if layout.spec is None else replace(layout.spec)
        self.optimizer.total_steps[slot] = layout.total_steps
