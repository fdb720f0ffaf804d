"""Per-token slot routing: one plan per micro-batch, shared by every MultiLoRA layer of a model.

``slot_ids`` come batch-first (``[batch, seq]``, like ``input_ids``); Megatron hidden states are
sequence-first, so the plan flattens tokens in ``[seq, batch]`` order. The plan holds the sort
permutation that groups routed tokens by slot and the per-slot segment counts (on the host, made
once per micro-batch, never per layer). :func:`build_routing_plan` reads the counts back from a
slot-id tensor on the device (the host waits for the GPU); :func:`row_routing_plan` builds the same
plan for rows of one slot each (training, prefill, scoring) from the host's slot list, without a
wait, and :func:`packed_routing_plan` for such rows packed into one sequence. Slot ``-1`` means
"base model only".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from miles_multilora.errors import ConfigError
from miles_multilora.host_tensors import to_device


@dataclass
class RoutingPlan:
    """Where each token goes. Built once per micro-batch by :func:`build_routing_plan`."""

    num_slots: int
    batch: int
    seq: int
    order: torch.Tensor  # [num_routed] long: token indices (seq-first flat order), grouped by slot
    sorted_slots: torch.Tensor  # [num_routed] long: the slot of each grouped token
    counts: tuple[int, ...]  # [num_slots] tokens per slot (host)
    offsets: torch.Tensor  # [num_slots] int32 cumulative segment ends (device), for grouped GEMM
    # [batch] long: set when every sequence's tokens share one slot (training rows, decode steps);
    # the layers then take the per-sequence path (batched GEMMs on strided views, no row gather).
    seq_slots: torch.Tensor | None = None
    # the slot of each segment in the grouped order, when it is not slot order (expert-major MoE
    # routing: slots are (slot, expert) groups; lora.expert_routing). A permutation of all slots.
    segment_slots: tuple[int, ...] | None = None
    _batch_first_order: torch.Tensor | None = field(default=None, repr=False)
    # Kernel schedules derived from ``counts`` (see lora.routed_ops), built once per plan.
    schedules: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.batch * self.seq

    @property
    def num_routed(self) -> int:
        return int(self.order.numel())

    @property
    def active_slots(self) -> list[int]:
        """Slots that got at least one token in this micro-batch."""
        return [s for s, c in enumerate(self.counts) if c > 0]

    def segments(self) -> list[tuple[int, int, int]]:
        """``(slot, start, end)`` in the grouped order, for non-empty slots only."""
        out, start = [], 0
        for slot in self.segment_slots if self.segment_slots is not None else range(self.num_slots):
            count = self.counts[slot]
            if count:
                out.append((slot, start, start + count))
                start += count
        return out

    def segment_counts(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens per segment in the grouped order (host) and the slot of each segment (None: the
        segments are the slots in order)."""
        counts = torch.tensor(self.counts, dtype=torch.long)
        if self.segment_slots is None:
            return counts, None
        ids = torch.tensor(self.segment_slots, dtype=torch.long)
        return counts[ids], ids

    def token_order(self, batch_first: bool = False) -> torch.Tensor:
        """Indices of the routed tokens into a flattened ``[seq, batch]`` (or ``[batch, seq]``) tensor."""
        if not batch_first:
            return self.order
        if self._batch_first_order is None:
            b = self.order % self.batch
            s = self.order // self.batch
            self._batch_first_order = b * self.seq + s
        return self._batch_first_order


def build_routing_plan(slot_ids: torch.Tensor, num_slots: int, per_sequence: bool = True) -> RoutingPlan:
    """Validate ``slot_ids`` ``[batch, seq]`` and group its tokens by slot (the host waits for the
    GPU to read the counts back: prefer :func:`row_routing_plan` where the host knows the slots).

    ``per_sequence``: allow the per-sequence fast path when each sequence has a single slot.
    """
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dim() != 2:
        shape = tuple(slot_ids.shape) if isinstance(slot_ids, torch.Tensor) else type(slot_ids).__name__
        raise ConfigError("slot_ids", f"must be a LongTensor [batch, seq] (like input_ids), got {shape}")
    if slot_ids.dtype not in (torch.int64, torch.int32):
        raise ConfigError("slot_ids", f"must be an integer tensor, got {slot_ids.dtype}")
    batch, seq = slot_ids.shape
    flat = slot_ids.t().reshape(-1).long()
    n = num_slots
    if flat.numel() == 0:
        raise ConfigError("slot_ids", "is empty")
    lo_hi = torch.stack(torch.aminmax(flat))
    hist = torch.bincount(flat.clamp(-1, n - 1) + 1, minlength=n + 1)
    uniform = (slot_ids == slot_ids[:, :1]).all().long().view(1)
    host = torch.cat([lo_hi, hist, uniform]).tolist()  # the plan's only device->host sync
    lo, hi, counts, is_uniform = host[0], host[1], host[3:-1], bool(host[-1])
    if lo < -1 or hi >= n:
        raise _out_of_range(lo if lo < -1 else hi, n)
    num_routed = flat.numel() - host[2]
    key = torch.where(flat < 0, torch.full_like(flat, n), flat)
    sorted_key, order = torch.sort(key, stable=True)
    offsets = to_device(torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32), flat.device)
    return RoutingPlan(
        num_slots=n,
        batch=batch,
        seq=seq,
        order=order[:num_routed],
        sorted_slots=sorted_key[:num_routed],
        counts=tuple(counts),
        offsets=offsets,
        seq_slots=slot_ids[:, 0].long() if (per_sequence and is_uniform) else None,
    )


def row_routing_plan(
    row_slots: Sequence[int], seq: int, num_slots: int, device: torch.device | str
) -> RoutingPlan:
    """:func:`build_routing_plan`'s plan for ``len(row_slots)`` rows of ``seq`` tokens, every token of
    row ``b`` routed to ``row_slots[b]`` (training rows): built from the host's slot list, so the
    GPU is never waited for; the tensors reach ``device`` without a host sync."""
    batch = len(row_slots)
    if batch == 0 or seq <= 0:
        raise ConfigError("slot_ids", "is empty")
    _check_slots(row_slots, num_slots)
    slots = torch.tensor(list(row_slots), dtype=torch.long)
    pieces = {}
    for slot in {s for s in row_slots if s >= 0}:
        rows = (slots == slot).nonzero().view(-1)
        # seq-first flat indices (position-major, then row), as a stable sort of every token by slot
        pieces[slot] = [(torch.arange(seq).view(-1, 1) * batch + rows.view(1, -1)).view(-1)]
    return _host_plan(num_slots, batch, seq, pieces, to_device(slots, device), device)


def packed_routing_plan(
    row_slots: Sequence[int], lengths: Sequence[int], num_slots: int, device: torch.device | str
) -> RoutingPlan:
    """:func:`build_routing_plan`'s plan for rows packed back to back into one sequence (``[1, T]``,
    ``models.packed_rows``): row ``i``'s ``lengths[i]`` tokens routed to ``row_slots[i]``. Built on
    the host, without a wait for the GPU."""
    if not row_slots or len(row_slots) != len(lengths) or min(lengths) <= 0:
        raise ConfigError("slot_ids", "is empty (or the rows' slots and lengths differ in number)")
    _check_slots(row_slots, num_slots)
    pieces: dict[int, list[torch.Tensor]] = {}
    start = 0
    for slot, length in zip(row_slots, lengths, strict=True):  # each slot's rows in order: a stable sort
        if slot >= 0:
            pieces.setdefault(slot, []).append(torch.arange(start, start + length))
        start += length
    one_slot = len(set(row_slots)) == 1
    seq_slots = to_device(torch.tensor(row_slots[:1], dtype=torch.long), device) if one_slot else None
    return _host_plan(num_slots, 1, start, pieces, seq_slots, device)


def _check_slots(row_slots: Sequence[int], num_slots: int) -> None:
    bad = [s for s in row_slots if s < -1 or s >= num_slots]
    if bad:
        raise _out_of_range(bad[0], num_slots)


def _host_plan(
    num_slots: int,
    batch: int,
    seq: int,
    pieces: dict[int, list[torch.Tensor]],
    seq_slots: torch.Tensor | None,
    device: torch.device | str,
) -> RoutingPlan:
    """The plan of tokens grouped by slot, from each routed slot's token indices in order
    (``pieces``, on the host): counts on the host, tensors copied to ``device`` without a sync."""
    counts = [0] * num_slots
    order, keys = [], []
    for slot in sorted(pieces):
        tokens = torch.cat(pieces[slot])
        counts[slot] = tokens.numel()
        order.append(tokens)
        keys.append(torch.full((counts[slot],), slot, dtype=torch.long))
    none = torch.zeros(0, dtype=torch.long)
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return RoutingPlan(
        num_slots=num_slots,
        batch=batch,
        seq=seq,
        order=to_device(torch.cat(order) if order else none, device),
        sorted_slots=to_device(torch.cat(keys) if keys else none, device),
        counts=tuple(counts),
        offsets=to_device(offsets, device),
        seq_slots=seq_slots,
    )


def _out_of_range(slot: int, num_slots: int) -> ConfigError:
    """The error for a slot id outside ``-1 .. num_slots - 1``."""
    return ConfigError("slot_ids", f"slot {slot} is out of range: use -1 (base only) or 0..{num_slots - 1}")
