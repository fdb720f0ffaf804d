"""Adapters beyond the resident slots: a slot's whole state parked off the GPU and back, exactly.

:func:`park` copies everything one rank holds for a slot (its LoRA tensors and optimizer state cut to
the adapter's own rank, as a saved state is; the gradients it has accumulated and not stepped yet;
its name, shape, seed, version and run id) into host memory, pinned on a GPU; the caller then
closes the slot.
:meth:`ParkedSlot.spill` moves a parked state on to disk (the saved-state shard format, one file
per TP rank) when host memory is short. :func:`unpark` puts it into any free slot, bit for bit: an
adapter parked and restored any number of times, in any slots, trains exactly like one that never
moved. :meth:`ParkedSlot.prefetch` starts its copy back to the GPU ahead of time (while the step
before its turn runs), so that the restore only writes the slot.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.lora.slots import slot_state
from miles_multilora.private_files import private_open
from miles_multilora.trainer import shard
from miles_multilora.trainer.host_copies import (
    HostPack,
    StagedCopy,
    cloned,
    device_buffers,
    pack_tensors,
    stage,
    to_device,
    to_host,
)
from miles_multilora.trainer.slot_rows import PackedRows, RowLayout

if TYPE_CHECKING:
    from miles_multilora.trainer.rank import OpenSlot, TrainerRank


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


@dataclass
class ParkedSlot:
    """One adapter's state off the GPU: in host memory (``pack``; ``saved``, its tree, once read)
    or spilled to ``path``."""

    meta: shard.SlotMeta
    run: str
    # {"slot", "optimizer", "meta", "grads"} as :func:`park` made it (None: rows in ``pack``, the
    # tree built when read; or spilled)
    saved: dict[str, Any] | None
    nbytes: int  # in host memory
    path: Path | None = None  # where it was spilled (``saved`` is None then)
    pack: HostPack | None = None  # the flat host buffers (pinned on a GPU) the state lives in
    staged: StagedCopy | None = None  # its copy back to the GPU, started by :meth:`prefetch`
    # ``pack`` as the slot's rows: restored without a plan (trainer/slot_rows.py)
    rows: RowLayout | None = None

    @property
    def in_memory(self) -> bool:
        return self.saved is not None or self.pack is not None

    @property
    def can_prefetch(self) -> bool:
        """In pinned host memory (on a GPU) and not on its way back yet."""
        return self.pack is not None and self.pack.device.type == "cuda" and self.staged is None

    def prefetch(self) -> int:
        """Start the copy back to the GPU now (overlapped with whatever runs until the restore);
        returns the device bytes it takes (0 when it cannot: no GPU pack, or spilled to disk)."""
        if not self.can_prefetch:
            return 0
        assert self.pack is not None
        self.staged = stage(self.pack)
        return self.staged.nbytes

    def drop_prefetch(self) -> None:
        """Give the prefetched device copy back (its turn did not come)."""
        self.staged = None

    def spill(self, directory: str | Path, tp_rank: int) -> None:
        """Move the state from host memory to ``directory`` (this TP rank's shard)."""
        if not self.in_memory:
            return
        directory = Path(directory)
        saved = self.state(tp_rank)
        if self.pack is not None:
            saved = cloned(saved)  # a view of a packed buffer would save the whole buffer
        shard.write_shard(directory, tp_rank, saved["slot"], saved["optimizer"], self.meta)
        if saved["grads"]:
            with private_open(directory / f"grads_rank{tp_rank}.pt", "wb") as f:
                torch.save(saved["grads"], f)
        self.path, self.saved, self.pack, self.staged, self.rows = directory, None, None, None, None

    def state(self, tp_rank: int) -> dict[str, Any]:
        """The parked state, read back from disk when it was spilled."""
        if self.pack is not None:
            self.pack.wait()
            if self.saved is None:
                assert self.rows is not None
                self.saved = self.rows.tree(self.pack, self.meta)
        if self.saved is not None:
            return self.saved
        assert self.path is not None
        saved = shard.read_shard(self.path, tp_rank)
        grads = self.path / f"grads_rank{tp_rank}.pt"
        saved["grads"] = torch.load(grads, weights_only=True) if grads.exists() else {}
        return saved

    def discard(self) -> None:
        """Forget the state (its spill directory too)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        self.saved, self.path, self.pack, self.staged, self.rows = None, None, None, None, None


def park(rank: TrainerRank, slot: int) -> ParkedSlot:
    """Copy open ``slot``'s whole state to host memory (the caller closes the slot after): views of
    the slot, copied by :func:`~miles_multilora.trainer.host_copies.to_host` (on a GPU one copy per
    dtype, on a copy stream: it overlaps whatever the step does next). The slot's rows, cut to the
    adapter's rank, are packed as they are (trainer/slot_rows.py); the saved-state tree is only
    built when read."""
    started = time.perf_counter()
    opened = rank.slot(slot)
    meta = shard.SlotMeta(opened.name, opened.rank, opened.alpha, opened.seed, opened.version, opened.targets)
    rows = rank.slot_rows.row_blocks(slot)
    if rows is not None:
        host = pack_tensors(rows)
        layout = rank.slot_rows.layout(slot, host)
        assert layout is not None  # whole rows by construction
        nbytes = sum(t.numel() * t.element_size() for t in host.buffers.values())
        rank.offload_stats["park"] += 1
        rank.offload_stats["park_s"] += time.perf_counter() - started
        return ParkedSlot(meta, opened.run, None, nbytes, pack=host, rows=layout)
    optimizer = rank.optimizer
    tensors, optim_state = shard.trim_to_rank(
        slot_state(rank.model, slot, views=True), optimizer.slot_state_dict(slot, views=True), copy=False
    )
    with_grad = [(n, p) for n, p in zip(optimizer.names, optimizer.params, strict=True) if p.grad is not None]
    nonzero = (
        torch.stack([p.grad[slot].any() for _, p in with_grad]).tolist() if with_grad else []
    )  # one sync
    grads = {name: p.grad[slot].detach() for (name, p), keep in zip(with_grad, nonzero, strict=True) if keep}
    saved, pack = to_host(
        {"slot": tensors, "optimizer": optim_state, "meta": shard.meta_dict(meta), "grads": grads},
        device_type=rank.device.type,
    )
    parked = ParkedSlot(meta, opened.run, saved, _nbytes(saved), pack=pack)
    rank.offload_stats["park"] += 1
    rank.offload_stats["park_s"] += time.perf_counter() - started
    return parked


def unpark(rank: TrainerRank, parked: ParkedSlot, slot: int) -> OpenSlot:
    """Open free ``slot`` with ``parked``'s state, exactly as it was (published to the engine)."""
    started = time.perf_counter()
    meta = parked.meta
    restore: dict[str, Any] | PackedRows
    rank.offload_stats["unpark_prefetched"] += parked.staged is not None
    if parked.rows is not None and parked.pack is not None:  # whole rows: trainer/slot_rows.py
        restore = PackedRows(meta, parked.rows, device_buffers(parked.pack, parked.staged))
        spec, total_steps = parked.rows.spec, parked.rows.total_steps
    else:
        restore = parked.state(rank.layout.tp_rank)
        spec = (
            OptimizerSpec(**restore["optimizer"]["optimizer"])
            if restore["optimizer"].get("optimizer")
            else None
        )
        total_steps = restore["optimizer"].get("total_steps")
        if parked.pack is not None:  # one copy per dtype back to the GPU (or prefetched), before the writes
            restore = to_device(restore, parked.pack, parked.staged)
    parked.staged = None
    opened = rank.open_slot(
        slot,
        meta.rank,
        meta.alpha,
        meta.seed,
        spec or OptimizerSpec(),
        meta.name,
        total_steps=total_steps,
        run=parked.run,
        restore=restore,
        targets=meta.targets,
    )  # fmt: skip  (the restore writes the gradients too: trainer/slot_write.py, slot_rows.py)
    rank.offload_stats["unpark"] += 1
    rank.offload_stats["unpark_s"] += time.perf_counter() - started
    return opened


def spill_over_budget(
    parked: Mapping[str, ParkedSlot],
    budget_bytes: int,
    directory: str | Path,
    tp_rank: int,
    last_used: Callable[[str], int],
) -> int:
    """Spill the least recently used of ``parked`` (name -> state) to ``directory / name`` until
    the ones left in host memory hold at most ``budget_bytes``; returns how many were spilled."""
    held = sorted((n for n, p in parked.items() if p.in_memory), key=last_used)
    total = sum(parked[n].nbytes for n in held)
    spilled = 0
    for name in held:
        if total <= budget_bytes:
            break
        total -= parked[name].nbytes
        parked[name].spill(Path(directory) / name, tp_rank)
        spilled += 1
    return spilled
