"""A decode step's mixture-of-experts layer with static shapes: no host sync, capturable.

Megatron's MoE forward reads its token counts on the host (the dispatcher's permutation, the
experts' loop). A decode step of ``B`` rows instead builds its ``B * k`` (row, chosen expert) pairs
on the device: Megatron's router picks the experts, the pairs are sorted by expert, the experts'
base GEMMs run over the sorted pairs (one grouped GEMM with device offsets in bf16 on a GPU,
:mod:`~miles_multilora.lora.expert_base`), each pair's expert LoRA comes from its row's slot and its
expert (weight group ``slot * E + expert``, a :class:`~miles_multilora.lora.row_routing.RowRouting`
over the pairs) and each row sums its ``k`` expert outputs in expert order (no atomics: a row's
result does not depend on the batch). Every shape is fixed by ``B``, so one captured graph serves
every routing and adapter mix. A shared expert runs on the rows as a dense MLP (its fc1/fc2 LoRA
routed by the rows' slots like the dense layers') and is added after the routed sum, as in the
trainer. With expert parallelism the step exchanges the rows with the other EP ranks around the
experts (:mod:`~miles_multilora.rollout.expert_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from miles_multilora.lora.moe import LoRAExperts, MultiLoRAMoELayer, as_lora_moe, check_moe, expert_activation
from miles_multilora.lora.row_routing import RowRouting, build_row_routing, tile_sizes


def is_moe(mlp: torch.nn.Module) -> bool:
    return isinstance(mlp, MoELayer)


def prepare_moe(moe: MoELayer) -> None:
    """Before any capture: a model without MultiLoRA gets the grouped-GEMM experts too (checked as
    for multi-LoRA, :func:`~miles_multilora.lora.moe.as_lora_moe`), and the experts' weight stacks
    exist (after a ``model.to`` a step's eager warm-up restacks them, which changes the graphs'
    fingerprint once)."""
    if not isinstance(moe, MultiLoRAMoELayer):
        check_moe(moe)
        as_lora_moe(moe)
    for proj in ("linear_fc1", "linear_fc2"):
        moe.experts.stacked(proj)
        moe.experts.stacked(proj, "bias")


def expert_pairs(moe: MoELayer, x2d: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's chosen experts ``[B * k]`` (ascending per row), their row and routing weight."""
    probs, routing_map = moe.router(x2d.unsqueeze(1))
    k = moe.config.moe_router_topk
    rows = x2d.shape[0]
    # the k chosen experts of each row, in expert order (a stable sort of the boolean map)
    chosen = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
    weight = probs.gather(1, chosen)
    row = torch.arange(rows, device=x2d.device).repeat_interleave(k)
    return chosen.reshape(-1), row, weight.reshape(-1)


def lora_groups(layer: MultiLoRAExpertLinear, row_slots: Tensor, experts: Tensor) -> RowRouting:
    """The pairs' weight groups ``slot * E + expert`` (``-1``: base only), routed on the device."""
    groups = torch.where(row_slots >= 0, row_slots * layer.num_local_experts + experts, -1)
    return build_row_routing(groups, layer.num_slots * layer.num_local_experts, tile_sizes())


def run_expert_pairs(
    cfg: TransformerConfig,
    experts: LoRAExperts,
    hidden: Tensor,
    weight: Tensor,
    expert: Tensor,
    project: Callable[..., Tensor],
    pair_slots: Callable[[RowRouting], Tensor],
) -> Tensor:
    """The routed experts' output of each (row, expert) pair, the pairs sorted by (local) ``expert``:
    fc1, the activation and fc2 with the slots' LoRA. ``project(proj, x, probs=None)``: the base
    projection over the pairs; ``pair_slots(routing)``: each pair's LoRA slot (``-1``: base only)."""
    if cfg.moe_apply_probs_on_input:
        hidden = (weight.unsqueeze(-1) * hidden).to(hidden.dtype)
        weight = torch.ones_like(weight)
    fc1_lora, fc2_lora = experts.lora_layer("linear_fc1"), experts.lora_layer("linear_fc2")
    routing = None
    for layer in (fc1_lora, fc2_lora):
        if layer is not None and isinstance(layer.routing, RowRouting):
            routing = lora_groups(layer, pair_slots(layer.routing), expert)
            break
    fc1 = project("linear_fc1", hidden)
    if fc1_lora is not None and routing is not None:
        fc1 = fc1_lora.add_lora_rows(hidden, fc1, routing)
    act = expert_activation(cfg, fc1, weight)
    out = project("linear_fc2", act, weight)
    if fc2_lora is not None and routing is not None:
        out = fc2_lora.add_lora_rows(act, out, routing)
    return out


def moe_decode(moe: MultiLoRAMoELayer, x: Tensor) -> Tensor:
    """The MoE layer's output for one token per row: ``x`` ``[1, B, H]`` -> ``[1, B, H]``."""
    experts: LoRAExperts = moe.experts
    cfg = moe.config
    x2d = x.reshape(-1, x.shape[-1])
    expert, row, weight = expert_pairs(moe, x2d)
    order = torch.sort(expert, stable=True).indices
    expert, row, weight = expert[order], row[order], weight[order]
    num_experts = moe.num_local_experts
    counts = torch.zeros(num_experts, dtype=torch.long, device=x.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    offsets = counts.cumsum(0).to(torch.int32)
    host_counts = counts.tolist() if not x.is_cuda else None  # the CPU loop (no graph on a CPU)
    out = run_expert_pairs(
        cfg, experts, x2d.index_select(0, row), weight, expert,
        lambda proj, h, probs=None: experts.project(proj, h, host_counts, offsets, expert, probs),
        lambda routing: routing.row_slots.reshape(-1).index_select(0, row),
    )  # fmt: skip
    k = cfg.moe_router_topk
    per_pair = torch.empty_like(out).index_copy_(0, order, out)  # back to (row, j) order
    routed = per_pair.view(-1, k, out.shape[-1]).sum(1).to(x.dtype).view(x.shape)
    return moe.add_shared_expert(routed, x)
