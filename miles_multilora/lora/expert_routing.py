"""Routing of MoE expert rows by (slot, expert) group: one plan per expert layer call.

After the token dispatcher, an MoE layer's experts see their rows sorted by expert (``counts`` rows
per local expert) and, carried through the dispatcher, each row's slot (``-1``: base only). The
expert LoRA of slot ``s`` on local expert ``e`` is weight group ``g = s * E + e`` of the stacked
``[slots, E, ...]`` tensors (a free view as ``[slots * E, ...]``), so one pass of the routed LoRA
kernels (:mod:`~miles_multilora.lora.routed_ops`, :mod:`~miles_multilora.lora.kernels`) serves
every (slot, expert) pair: the tile lists have no cap on their number of groups.

Two orders of the groups' rows (both exact; ``benchmarks/moe_layer.py`` measures them):

* ``slot_major``: slot segments, each cut by expert (groups in weight order). A shared ``A`` (one
  per slot for every expert) then reads the same rows in the same order.
* ``expert_major``: expert segments (the dispatcher's order), each cut by slot; the plan's
  ``segment_slots`` maps segments to weight groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_multilora.errors import ConfigError
from miles_multilora.lora.routing import RoutingPlan, build_routing_plan
from miles_multilora.lora.row_routing import RowRouting

SLOT_MAJOR, EXPERT_MAJOR = "slot_major", "expert_major"
ROUTING_ORDERS = (SLOT_MAJOR, EXPERT_MAJOR)


def check_order(order: str) -> str:
    if order not in ROUTING_ORDERS:
        raise ConfigError("lora.expert_routing", f"must be one of {ROUTING_ORDERS}, got {order!r}")
    return order


@dataclass
class ExpertPlan:
    """Where each expert row goes in one expert layer call."""

    groups: RoutingPlan  # over weight groups g = slot * num_experts + expert (the B matrices, and A's)
    # the plan of a shared A (over slots) and, when its rows are in another order than the groups',
    # the position of each group-ordered row in it; None: A per expert (``groups`` serves both)
    shared: RoutingPlan | None = None
    shared_to_groups: torch.Tensor | None = None

    @property
    def num_routed(self) -> int:
        return self.groups.num_routed


def _empty_plan(n: int, device: torch.device) -> RoutingPlan:
    none = torch.zeros(0, dtype=torch.long, device=device)
    return RoutingPlan(n, 1, 0, none, none, (0,) * n, torch.zeros(n, dtype=torch.int32, device=device))


def _slot_plan(groups: RoutingPlan, num_slots: int, num_experts: int) -> RoutingPlan:
    """The slot-major groups' own rows, seen as slot segments (a shared A's plan, no re-sort)."""
    counts = tuple(sum(groups.counts[s * num_experts : (s + 1) * num_experts]) for s in range(num_slots))
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return RoutingPlan(
        num_slots=num_slots,
        batch=1,
        seq=groups.seq,
        order=groups.order,
        sorted_slots=torch.div(groups.sorted_slots, num_experts, rounding_mode="floor"),
        counts=counts,
        offsets=offsets.to(groups.order.device, non_blocking=True),
    )


def build_expert_plan(
    row_slots: torch.Tensor,
    counts: list[int],
    num_slots: int,
    order: str = SLOT_MAJOR,
    shared_a: bool = False,
) -> ExpertPlan:
    """Group the rows ``[T]`` (sorted by expert, ``counts[e]`` rows of local expert ``e``) by
    (slot, expert); ``row_slots`` ``[T]`` long, ``-1`` = base only. One host sync (the counts)."""
    num_experts = len(counts)
    rows = int(row_slots.numel())
    if sum(counts) != rows:
        raise ConfigError("row_slots", f"{rows} expert rows, but the experts' counts add up to {sum(counts)}")
    device = row_slots.device
    if rows == 0:  # an expert-parallel rank may get no rows at all
        empty = _empty_plan(num_slots * num_experts, device)
        return ExpertPlan(empty, _empty_plan(num_slots, device) if shared_a else None)
    expert = torch.repeat_interleave(
        torch.arange(num_experts, device=device), torch.tensor(counts, device=device), output_size=rows
    )
    slots = row_slots.long()
    routed = slots >= 0
    weight_group = torch.where(routed, slots * num_experts + expert, -1)
    n_groups = num_slots * num_experts
    if order == SLOT_MAJOR:
        groups = build_routing_plan(weight_group.view(1, -1), n_groups, per_sequence=False)
    else:
        check_order(order)
        position = torch.where(routed, expert * num_slots + slots, -1)
        by_position = build_routing_plan(position.view(1, -1), n_groups, per_sequence=False)
        pos = torch.arange(n_groups)
        group_of = (pos % num_slots) * num_experts + pos // num_slots  # segment position -> weight group
        counts_by_group = [0] * n_groups
        for p, c in enumerate(by_position.counts):
            counts_by_group[int(group_of[p])] = c
        groups = RoutingPlan(
            num_slots=n_groups,
            batch=1,
            seq=rows,
            order=by_position.order,
            sorted_slots=group_of.to(device)[by_position.sorted_slots],
            counts=tuple(counts_by_group),
            offsets=torch.tensor(counts_by_group).cumsum(0).to(torch.int32).to(device),
            segment_slots=tuple(group_of.tolist()),
        )
    if not shared_a:
        return ExpertPlan(groups)
    if order == SLOT_MAJOR:
        return ExpertPlan(groups, _slot_plan(groups, num_slots, num_experts))
    shared = build_routing_plan(slots.view(1, -1), num_slots, per_sequence=False)
    where = torch.empty(rows, dtype=torch.long, device=device)
    where[shared.order] = torch.arange(shared.num_routed, device=device)
    return ExpertPlan(groups, shared, where[groups.order])


def token_slot_ids(routing: RoutingPlan | RowRouting | None, num_tokens: int) -> torch.Tensor:
    """Each token's slot ``[num_tokens]`` (sequence-first flat order, as Megatron's hidden states) from
    a model's token routing: a :class:`RoutingPlan` (training, prefill) or :class:`RowRouting` (decode)."""
    if routing is None:
        raise RuntimeError(
            "the MoE layer's expert LoRA has no token routing: call set_token_slots(model, slot_ids) "
            "(slot -1 = base only) before the forward"
        )
    if isinstance(routing, RowRouting):
        slots = routing.row_slots.reshape(-1)
    else:
        cached = routing.schedules.get("token_slots")
        if cached is None:
            cached = torch.full((routing.num_tokens,), -1, dtype=torch.long, device=routing.order.device)
            cached.index_copy_(0, routing.order, routing.sorted_slots)
            routing.schedules["token_slots"] = cached
        slots = cached
    if slots.numel() != num_tokens:
        raise ConfigError(
            "slot_ids",
            f"routes {slots.numel()} tokens but the MoE layer got {num_tokens}: pass slot_ids "
            "shaped like input_ids [batch, seq]",
        )
    return slots
