"""Routing of one token per row whose slots live in a device tensor: no host counts, graph-safe.

A decode step has one token per row and any mix of slots (``-1`` = base only). Unlike
:class:`~miles_multilora.lora.routing.RoutingPlan` (one host sync per micro-batch), a
:class:`RowRouting` is built from ``row_slots`` with device ops only: rows are sorted by slot and
each slot's segment is cut into tiles of ``BLOCK_M`` rows, in a tile list of fixed length
``cdiv(rows, BLOCK_M) + num_slots`` whose unused entries are empty (``start == end``; the kernels
return at once on them). The same captured CUDA graph therefore serves every adapter mix, and
replays see whatever slots the row tensor holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class RowRouting:
    """Where each row's token goes (built by :func:`build_row_routing`)."""

    num_slots: int
    row_slots: torch.Tensor  # [rows] long, -1 = base only
    order: torch.Tensor  # [rows] long: row indices grouped by slot (base-only rows last)
    sorted_slots: torch.Tensor  # [rows] long: slot of each grouped row (num_slots for base rows)
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # BLOCK_M -> [3, n] int32 slot/start/end
    # the same over every row: base-only rows form one more segment, of slot ``num_slots``; its
    # non-empty tiles come first, and ``all_tile_counts`` ([1] int32) says how many there are
    all_tiles: dict[int, torch.Tensor] = field(default_factory=dict)
    all_tile_counts: dict[int, torch.Tensor] = field(default_factory=dict)
    side_stream: torch.cuda.Stream | None = None  # CUDA: the LoRA overlaps the base GEMM there
    # the shrink is one dense GEMM of every slot for every row (the expand picks each row's slot),
    # not the split-K kernel over slot tiles: cheaper for many rows per slot
    dense_shrink: bool = False
    # a consumer kernel that can run the expand itself (the SwiGLU after fc1) gets the shrink only
    # (MultiLoRALinear.forward_deferred's RowShrink)
    expand_in_consumer: bool = False
    # layers with a stacked weight (every slot's lora_A under the base weight) take the shrink from
    # the base GEMM's extra columns (MultiLoRALinear.forward_deferred; many rows per step)
    stacked_shrink: bool = False

    @property
    def rows(self) -> int:
        return int(self.row_slots.numel())


def _tiles(
    counts: torch.Tensor, seg_start: torch.Tensor, rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[3, cdiv(rows, block_m) + num_slots]`` int32 (slot, start, end) tiles of every segment, the
    non-empty ones first, and how many those are (``[1]`` int32)."""
    num_slots = counts.numel()
    per_slot = (counts + block_m - 1) // block_m
    cum = per_slot.cumsum(0)
    t = torch.arange((rows + block_m - 1) // block_m + num_slots, device=counts.device)
    slot = torch.searchsorted(cum, t, right=True)
    valid = slot < num_slots
    slot = slot.clamp(max=num_slots - 1)
    start = seg_start[slot] + (t - (cum[slot] - per_slot[slot])) * block_m
    end = torch.minimum(start + block_m, seg_start[slot] + counts[slot])
    zero = torch.zeros_like(start)
    tiles = torch.stack([slot, torch.where(valid, start, zero), torch.where(valid, end, zero)])
    return tiles.to(torch.int32), cum[-1:].to(torch.int32)


def build_row_routing(
    row_slots: torch.Tensor, num_slots: int, block_ms: Iterable[int] = (), all_rows: bool = False
) -> RowRouting:
    """Group ``row_slots`` ``[rows]`` by slot on the device; tiles for each ``BLOCK_M`` in ``block_ms``
    (``tiles``: the routed rows; with ``all_rows`` also ``all_tiles``: every row, for a kernel that
    passes base rows on too).

    No host sync and no data-dependent shapes (capturable in a CUDA graph). Slots outside
    ``[-1, num_slots)`` are not checked here: the caller owns the row tensor.
    """
    slots = row_slots.reshape(-1).long()
    key = torch.where(slots < 0, torch.full_like(slots, num_slots), slots)
    sorted_slots, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount would sync for its output size
    seg_start = counts.cumsum(0) - counts
    routing = RowRouting(num_slots, slots, order, sorted_slots)
    for block_m in sorted(set(block_ms)):
        routing.tiles[block_m] = _tiles(counts[:num_slots], seg_start[:num_slots], slots.numel(), block_m)[0]
        if all_rows:
            routing.all_tiles[block_m], routing.all_tile_counts[block_m] = _tiles(
                counts, seg_start, slots.numel(), block_m
            )
    return routing


def tile_sizes() -> tuple[int, ...]:
    """The ``BLOCK_M`` values of the Triton decode shrink and expand kernels."""
    from miles_multilora.lora import triton_kernels as tk

    return tuple(sorted({tk.DECODE_SHRINK_CONFIG["BLOCK_M"], tk.DECODE_EXPAND_CONFIG["BLOCK_M"]}))
