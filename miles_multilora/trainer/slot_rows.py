"""A parked slot written back as its rows: one split and one or two multi-tensor copies per dtype.

The general restore (:mod:`~miles_multilora.trainer.slot_write`) takes a saved state as a tree of
~1,100 tensors, checks each, cuts it to the adapter's rank and pairs it with its slot row: ~20
tensor operations of host time per tensor, ~15 ms per rank-16 adapter of the 1.70 B benchmark shape
on an H200, where the copies themselves take 0.3 ms. A park knows where every tensor came from, so
none of that is needed: it gathers the slot's rows, each cut to its layer's rank as a saved state
is (:meth:`SlotRows.row_blocks`; whole rows at ``max_rank``, views made once per slot), and notes
which rows its flat buffers hold, in buffer order, with the slot's Python-side settings
(:meth:`SlotRows.layout`). :meth:`SlotRows.write` splits each buffer into those pieces and writes
them with one foreach copy per dtype into flat views of the slot's whole rows. Blocks cut below
``max_rank`` are restored in groups of one shape on a GPU (a group's blocks stacked and padded back
to whole rows with one kernel) rather than as a strided copy each, launched from the host; on a CPU
each moves on its own. A park reads each cut block as a strided view. The saved-state tree is built from the
buffers only when something reads it (:meth:`RowLayout.tree`). Bit for bit what the general path
writes and builds (``tests/unit/test_slot_write.py``, at full rank, cut, and with untrained layers).
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
    """What a park packed as rows: per dtype the tree paths in buffer order, their sizes and shapes;
    the slot's per-layer rank, scale and PEFT shape; its optimizer step, spec and horizon."""

    paths: dict[torch.dtype, list[TreePath]]
    sizes: dict[torch.dtype, list[int]]
    blocks: dict[torch.dtype, list[torch.Size | None]]  # a block cut to its layer's rank (None: whole)
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
    """A parked state to restore as rows: its meta, its layout and its flat buffers, on the
    model's device (what :meth:`~miles_multilora.trainer.rank.TrainerRank.open_slot` takes as
    ``restore``)."""

    meta: SlotMeta
    layout: RowLayout
    buffers: dict[torch.dtype, torch.Tensor]


class SlotRows:
    """The slot rows of a model's MultiLoRA layers and their :class:`SlotAdamW` state, by the tree
    path a park gives them (``("slot", "<layer>.lora_A")``, ``("optimizer", "exp_avg", name)``,
    ``("grads", name)``, ...), with views of each slot's rows made once. An adapter below
    ``max_rank`` in a layer keeps only the leading block of that layer's rows (its rank along the
    rank dimension: ``A`` ``[..., r, in]``, ``B`` ``[..., out, r]``), as a saved state does."""

    group_cut_blocks: bool | None = None  # restores: None = grouped on a GPU (see _grouped); tests set it

    def __init__(self, model: torch.nn.Module, optimizer: SlotAdamW) -> None:
        self.layers = multi_lora_layers(model)
        self.optimizer = optimizer
        self._full: dict[TreePath, torch.Tensor] = {}  # [num_slots, ...] tensors
        self._cut: dict[TreePath, tuple[int, int]] = {}  # path -> (its layer's index, rank dim)
        index = {layer.key: i for i, layer in enumerate(self.layers)}
        for i, layer in enumerate(self.layers):
            for which, dim in (("lora_A", -2), ("lora_B", -1)):
                # detached: the views made of it carry no autograd history, whatever mode they
                # are made in and whatever mode later writes the parameter
                self._full[("slot", f"{layer.key}.{which}")] = getattr(layer, which).detach()
                self._cut[("slot", f"{layer.key}.{which}")] = (i, dim)
        for i, name in enumerate(optimizer.names):
            layer_key, _, which = name.rpartition(".")
            cut = (index[layer_key], -2 if which == "lora_A" else -1) if layer_key in index else None
            parts = [("exp_avg", optimizer.exp_avg[i]), ("exp_avg_sq", optimizer.exp_avg_sq[i])]
            if optimizer.master[i] is not None:
                parts.append(("master", optimizer.master[i]))
            for part, t in parts:
                self._full[("optimizer", part, name)] = t
                if cut is not None:
                    self._cut[("optimizer", part, name)] = cut
        self._param = {name: p for name, p in zip(optimizer.names, optimizer.params, strict=True)}
        self._row_shape = {path: t.shape[1:] for path, t in self._full.items()}
        self._row_shape.update({("grads", n): p.shape[1:] for n, p in self._param.items()})
        self._usable = all(t.is_contiguous() for t in self._full.values()) and all(
            path in self._cut for path in self._full
        )
        self._views: dict[int, dict[TreePath, torch.Tensor]] = {}  # flat, per slot
        self._shaped: dict[int, dict[TreePath, torch.Tensor]] = {}  # as the saved-state tree has them
        self._grad_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def layout(self, slot: int, pack: HostPack) -> RowLayout | None:
        """``pack`` (a park of ``slot`` by :meth:`row_blocks`, taken just now) as rows, or None when
        any tensor in it is not a leading block of its row or a row the restore must write is
        missing from it."""
        if not self._usable:
            return None
        needed = set(self._full)
        paths: dict[torch.dtype, list[TreePath]] = {}
        sizes: dict[torch.dtype, list[int]] = {}
        blocks: dict[torch.dtype, list[torch.Size | None]] = {}
        for path, dtype, _, shape in pack.places:
            row = self._row_shape.get(path)
            if row is None or len(row) != len(shape) or any(n > m for n, m in zip(shape, row, strict=True)):
                return None
            needed.discard(path)
            paths.setdefault(dtype, []).append(path)
            sizes.setdefault(dtype, []).append(shape.numel())
            blocks.setdefault(dtype, []).append(None if shape == row else shape)
        if needed:
            return None
        opt = self.optimizer
        spec = opt.specs[slot]
        return RowLayout(
            paths, sizes, blocks,
            frozenset(p[1] for group in paths.values() for p in group if p[0] == "grads"),
            [int(layer.slot_rank[slot]) for layer in self.layers],
            [float(layer.slot_scale[slot]) for layer in self.layers],
            [_shapes(layer)[slot] for layer in self.layers],
            int(opt.steps[slot]), None if spec is None else replace(spec), opt.total_steps[slot],
            tuple(layer.key for layer in self.layers), tuple(opt.names),
        )  # fmt: skip

    def row_blocks(self, slot: int) -> list[tuple[TreePath, torch.Tensor]] | None:
        """Every part of ``slot`` a park keeps, by path: views of its rows cut to each layer's rank
        (whole at ``max_rank``), and the gradient rows when any of them is not zero (one sync); None
        when the model's slot tensors cannot be viewed so (not contiguous)."""
        if not self._usable:
            return None
        shaped = self._shaped_rows(slot)
        ranks = [int(layer.slot_rank[slot]) for layer in self.layers]
        items = []
        for path, row in shaped.items():
            i, dim = self._cut[path]
            # a block cut below max_rank stays a strided view: the pack's gather reads it once
            # (stacking a shape's rows first and narrowing them measured slower on an H200)
            items.append((path, row if ranks[i] == row.shape[dim] else row.narrow(dim, 0, ranks[i])))
        with_grad = [n for n, p in self._param.items() if p.grad is not None]
        if with_grad and bool(torch.cat([self._grad_row(slot, n) for n in with_grad]).any()):
            items += [(("grads", n), self._param[n].grad[slot]) for n in with_grad]  # type: ignore[index]
        return items

    def _grouped(self, t: torch.Tensor) -> bool:
        """Whether a restore writes blocks cut below ``max_rank`` in groups of one shape (one stack
        and one pad per group: on a GPU, where a strided copy per block costs a launch from the
        host) or each on its own (on a CPU, where the launches are free and the group's whole rows
        would be more bytes to move)."""
        return self.group_cut_blocks if self.group_cut_blocks is not None else t.is_cuda

    def _shaped_rows(self, slot: int) -> dict[TreePath, torch.Tensor]:
        shaped = self._shaped.get(slot)
        if shaped is None:
            shaped = self._shaped[slot] = {path: t[slot] for path, t in self._full.items()}
        return shaped

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
        device), into ``slot`` with its settings: a whole row in one piece, a block cut to its
        layer's rank into the row's leading block with the rest of the row zero; gradient rows the
        park did not hold become zero."""
        rows, shaped = self._rows(slot), self._shaped_rows(slot)
        grouped = self._grouped(next(iter(self._full.values())))
        for name in layout.grads:
            if self._param[name].grad is None:
                self._param[name].grad = torch.zeros_like(self._param[name])
        zero = [
            self._grad_row(slot, n)
            for n, p in self._param.items()
            if p.grad is not None and n not in layout.grads
        ]
        zero += [rows[p] for dtype, group in layout.paths.items()
                 for p, block in zip(group, layout.blocks[dtype], strict=True)
                 if block is not None and not grouped]  # fmt: skip
        if zero:
            torch._foreach_zero_(zero)
        for dtype, paths in layout.paths.items():
            whole_dst, whole_src, cut_dst, cut_src = [], [], [], []
            cut: dict[tuple[torch.Size, torch.Size], list[tuple[TreePath, torch.Tensor]]] = {}
            pieces = buffers[dtype].split(layout.sizes[dtype])
            for path, block, src in zip(paths, layout.blocks[dtype], pieces, strict=True):
                if path[0] == "grads":
                    whole_dst.append(self._grad_row(slot, path[1]))
                    whole_src.append(src)
                elif block is None:
                    whole_dst.append(rows[path])
                    whole_src.append(src)
                elif not grouped:  # the leading block, zeroed around (rows zeroed above)
                    cut_dst.append(shaped[path][tuple(slice(0, n) for n in block)])
                    cut_src.append(src.view(block))
                else:  # a leading block: widened to its whole row below, with the blocks of its shape
                    cut.setdefault((shaped[path].shape, block), []).append((path, src))
            for (row, block), group in cut.items():
                widened = _widen(torch.stack([src.view(block) for _, src in group]), row)
                whole_dst += [rows[path] for path, _ in group]
                whole_src += list(widened.view(len(group), -1).unbind(0))
            for dst, src in ((whole_dst, whole_src), (cut_dst, cut_src)):
                if dst:
                    torch._foreach_copy_(dst, src)
        scale_rows = [rows[("scale", layer.key)] for layer in self.layers]
        # a layer the adapter does not train (rank 0) serves nothing: scale 0, no PEFT shape
        scales = [scale if rank else 0.0 for rank, scale in zip(layout.ranks, layout.scales, strict=True)]
        # fp32, rounded once from the Python floats, as set_slot_scale does
        torch._foreach_copy_(
            scale_rows, list(tensor_on(scales, scale_rows[0].device, torch.float32).split(1))
        )
        for layer, rank, scale, shape in zip(self.layers, layout.ranks, scales, layout.shapes, strict=True):
            layer.slot_rank[slot] = rank
            layer.slot_scale[slot] = scale
            _shapes(layer)[slot] = shape if rank else None
        self.optimizer.steps[slot] = layout.step
        self.optimizer.specs[slot] = None if layout.spec is None else replace(layout.spec)
        self.optimizer.total_steps[slot] = layout.total_steps


def _widen(blocks: torch.Tensor, row: torch.Size) -> torch.Tensor:
    """``blocks`` ``[k, *block]`` (leading blocks of rows shaped ``row``) as ``[k, *row]``, zero
    beyond each block: one padding kernel for all ``k``, so a state cut below ``max_rank`` is
    written as whole rows, not as a strided copy per block."""
    pad: list[int] = []
    for have, want in zip(reversed(blocks.shape[1:]), reversed(row), strict=True):
        pad += [0, want - have]
    return torch.nn.functional.pad(blocks, pad)
