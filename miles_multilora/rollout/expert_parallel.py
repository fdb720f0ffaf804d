"""Expert parallelism in the embedded engine (``model.ep > 1``): attention data-parallel, experts
exchanged.

Each EP rank decodes its own rows (its own requests, KV pages and batch); only the MoE layers
need the other ranks, whose experts the rank's tokens route to. Two exchanges:

- **prefill** runs the MoE layer's training forward, whose token dispatcher (all-gather or
  all-to-all over EP) already moves tokens between the ranks;
- **a decode step** (:func:`moe_decode_ep`) gathers every EP rank's rows (``[ep * B, H]``, every
  rank padded to the same ``B``) and their slots, routes them all (the router is replicated),
  runs this rank's experts on the (row, expert) pairs that chose one of them (static shapes: the
  other pairs sort last, past the grouped GEMM's offsets, and are masked), sums each row's pairs
  in fp32 and reduce-scatters the partial sums, so each rank gets its own rows' full MoE output.
  No host sync on a GPU; the exchange is two collectives per MoE layer and step.

Every forward is a collective over the EP group, so the ranks run their prefill and decode
forwards in lockstep (:mod:`~miles_multilora.rollout.lockstep`), agreeing on each round's
forwards with :meth:`ExpertParallel.agree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from torch import Tensor

from miles_multilora.lora.moe import LoRAExperts, MultiLoRAMoELayer
from miles_multilora.lora.row_routing import RowRouting
from miles_multilora.rollout.moe_decode import expert_pairs, run_expert_pairs


class ExpertParallel:
    """The engine's expert-parallel group (``size`` ranks, this one ``rank``): the lockstep
    agreements and the decode step's row exchange, on ``device``."""

    def __init__(self, group: Any, device: torch.device, equal_tokens: bool = False) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        # the all-gather dispatcher gathers as many tokens from every rank: prefill forwards are
        # padded to the same shape on every EP rank (RowStarter._forward)
        self.equal_tokens = equal_tokens
        self._slots: tuple[RowRouting, Tensor] | None = None  # this step's routing, every rank's slots

    @classmethod
    def of_model(cls, model: torch.nn.Module, device: torch.device) -> ExpertParallel | None:
        """The EP group of ``model`` (the initialised Megatron state) when it has more than one EP
        rank, else None."""
        if not parallel_state.model_parallel_is_initialized():
            return None
        if parallel_state.get_expert_model_parallel_world_size() <= 1:
            return None
        gathers = any(isinstance(m, MoEAllGatherTokenDispatcher) for m in _dispatchers(model))
        return cls(parallel_state.get_expert_model_parallel_group(), device, equal_tokens=gathers)

    def agree(self, values: Sequence[int]) -> list[int]:
        """The largest of each value over the EP ranks (negate one to take the smallest): one
        all-reduce, read on the host."""
        t = torch.tensor(list(values), dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def gather_rows(self, x: Tensor) -> Tensor:
        """Every EP rank's ``x`` (the same shape on each), stacked along dim 0 in rank order."""
        out = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def scatter_sum(self, partial: Tensor) -> Tensor:
        """``partial`` ``[size * B, ...]`` summed over the EP ranks; this rank's ``B`` rows of it."""
        out = partial.new_empty(partial.shape[0] // self.size, *partial.shape[1:])
        dist.reduce_scatter_tensor(out, partial.contiguous(), group=self.group)
        return out

    def row_slots(self, routing: RowRouting) -> Tensor:
        """Every EP rank's row slots of this decode step (gathered once per step: the first MoE
        layer's call gathers them, the others reuse them while the routing is the same object)."""
        if self._slots is None or self._slots[0] is not routing:
            self._slots = (routing, self.gather_rows(routing.row_slots.reshape(-1)))
        return self._slots[1]


def _dispatchers(model: torch.nn.Module) -> list[Any]:
    return [m.token_dispatcher for m in model.modules() if isinstance(m, MoELayer)]


def _project(
    experts: LoRAExperts,
    proj: str,
    x: Tensor,
    counts: list[int] | None,
    offsets: Tensor,
    row_experts: Tensor,
    probs: Tensor | None = None,
) -> Tensor:
    """A projection of this rank's experts over pairs sorted by local expert, the other ranks' pairs
    last. With host ``counts`` (a CPU) only the local pairs run and the rest are zeros; on a GPU
    every row goes through (the grouped GEMM stops at the last offset; the caller masks the rest)."""
    if counts is None:
        return experts.project(proj, x, None, offsets, row_experts, probs)
    local = sum(counts)
    out = experts.project(
        proj, x[:local], counts, offsets, row_experts[:local], probs[:local] if probs is not None else None
    )
    return torch.cat([out, out.new_zeros(x.shape[0] - local, out.shape[1])])


def moe_decode_ep(moe: MultiLoRAMoELayer, x: Tensor, ep: ExpertParallel) -> Tensor:
    """The MoE layer's output for one token per row, its experts split over the EP ranks: ``x``
    ``[1, B, H]`` -> ``[1, B, H]``. Every EP rank calls it with the same ``B`` (a collective)."""
    experts: LoRAExperts = moe.experts
    cfg = moe.config
    x2d = x.reshape(-1, x.shape[-1])
    tokens = ep.gather_rows(x2d)  # [ep * B, H]: every rank's rows, in rank order
    expert, row, weight = expert_pairs(moe, tokens)
    first, num_local = moe.local_expert_indices[0], moe.num_local_experts
    local = (expert >= first) & (expert < first + num_local)
    key = torch.where(local, expert - first, num_local)  # the other ranks' pairs sort last
    order = torch.sort(key, stable=True).indices
    key, row, weight, local = key[order], row[order], weight[order], local[order]
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = counts[:num_local].cumsum(0).to(torch.int32)
    host_counts = counts[:num_local].tolist() if not x.is_cuda else None  # the CPU loop (no graph there)
    local_expert = key.clamp(max=num_local - 1)  # an index for the masked pairs too
    mask = local.unsqueeze(-1)
    hidden = torch.where(mask, tokens.index_select(0, row), 0)
    out = run_expert_pairs(
        cfg, experts, hidden, weight, local_expert,
        lambda proj, h, probs=None: _project(experts, proj, h, host_counts, offsets, local_expert, probs),
        lambda routing: torch.where(local, ep.row_slots(routing).index_select(0, row), -1),
    )  # fmt: skip
    out = torch.where(mask, out, 0).float()  # rows past the grouped GEMM's last offset are not written
    k = cfg.moe_router_topk
    per_pair = torch.empty_like(out).index_copy_(0, order, out)  # back to (row, j) order
    partial = per_pair.view(-1, k, out.shape[-1]).sum(1)  # this rank's experts' share of each row
    routed = ep.scatter_sum(partial).to(x.dtype).view(x.shape)
    return moe.add_shared_expert(routed, x)
