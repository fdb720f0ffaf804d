"""Mixture-of-experts layers with per-slot LoRA on the experts.

:func:`inject_moe` turns every Megatron ``MoELayer`` of a model into a :class:`MultiLoRAMoELayer`
and its ``SequentialMLP`` experts into :class:`LoRAExperts` (same modules, same parameters, one more
behaviour each), with a :class:`~miles_multilora.lora.expert_layer.MultiLoRAExpertLinear` on fc1 and
fc2 of all local experts when those are targets. The router stays frozen.

A forward (training, prefill):

1. each token's slot comes from the model's token routing (``set_token_slots``);
2. Megatron's router picks the experts; its token dispatcher permutes and moves the tokens and
   the slot ids follow them (:mod:`~miles_multilora.lora.expert_dispatch`);
3. the experts run their base GEMMs over rows sorted by expert (:mod:`expert_base`), and each
   projection's LoRA is one routed pass over every (slot, expert) group (:mod:`expert_routing`);
4. the dispatcher combines the rows back.

A shared expert (Qwen2-MoE / DeepSeek / GLM: ``moe_shared_expert_intermediate_size``, optionally
gated) is Megatron's ``SharedExpertMLP`` run on every token beside the routed experts and added
after them (:meth:`MultiLoRAMoELayer.add_shared_expert`); its fc1/fc2 are plain ``MultiLoRALinear``
layers, wrapped by ``apply_multi_lora`` as dense MLP linears (keys ``layers.{i}.shared_experts.*``).

Nothing here couples the adapters of a batch: token dropping, auxiliary and z-losses and input
jitter are refused (:func:`check_moe`). Experts are whole on each rank (expert tensor
parallelism 1). Under TP without expert parallelism every TP rank runs the whole MoE layer on its
(replicated) tokens; with expert parallelism each TP rank routes its share of the tokens, as
Megatron's sequence parallelism would, so that no token is sent twice to an expert.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch import nn

from miles_multilora.errors import ConfigError
from miles_multilora.lora import expert_dispatch
from miles_multilora.lora.expert_base import grouped_linear, holds, stack_weights
from miles_multilora.lora.expert_layer import EXPERT_PROJECTIONS, MultiLoRAExpertLinear
from miles_multilora.lora.expert_routing import SLOT_MAJOR, ExpertPlan, build_expert_plan, token_slot_ids


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def check_moe(moe: MoELayer) -> None:
    """Refuse MoE features that couple the adapters of a batch or that the expert LoRA cannot follow."""
    cfg = moe.config
    router = moe.router
    problems = [
        (cfg.moe_expert_capacity_factor is not None, "moe_expert_capacity_factor", "token dropping"),
        (router.is_aux_loss_enabled(), "moe_aux_loss_coeff", "an auxiliary load-balancing loss"),
        (cfg.moe_z_loss_coeff is not None, "moe_z_loss_coeff", "the router z-loss"),
        (cfg.moe_input_jitter_eps is not None, "moe_input_jitter_eps", "router input jitter"),
        (bool(cfg.moe_shared_expert_overlap), "moe_shared_expert_overlap", "overlapping the shared expert"),
        (bool(cfg.moe_latent_size), "moe_latent_size", "MoE latent projections"),
        (bool(cfg.moe_router_padding_for_quantization), "moe_router_padding_for_quantization", "padding"),
        (bool(cfg.moe_permute_fusion), "moe_permute_fusion", "Transformer Engine's permutation"),
        (cfg.moe_router_force_load_balancing, "moe_router_force_load_balancing", "random routing"),
        (
            cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or []),
            "recompute_modules",
            "recomputing the MoE layer alone (use core_attn or full recompute)",
        ),
        (not isinstance(moe.experts, SequentialMLP), "moe_grouped_gemm", "grouped-GEMM expert modules"),
    ]
    for bad, key, what in problems:
        if bad:
            raise ConfigError(
                f"model.{key}",
                f"{what} is not supported with multi-LoRA MoE (it couples the adapters of a batch, or "
                "the expert LoRA cannot follow it): turn it off",
            )
    expert_dispatch.check_dispatcher(moe.token_dispatcher)
    if moe.experts.tp_group is not None and moe.experts.tp_group.size() > 1:
        raise ConfigError("model.expert_tensor_parallel_size", "experts must be whole on each rank (1)")


def validate_moe(model: nn.Module, shared_expert_a: bool = False) -> list[MoELayer]:
    """The model's MoE layers, each checked (:func:`check_moe`) for multi-LoRA."""
    layers = moe_layers(model)
    for moe in layers:
        check_moe(moe)
    if shared_expert_a and any(moe.token_dispatcher.ep_size > 1 for moe in layers):
        raise ConfigError(
            "lora.shared_expert_a", "a shared expert A is not supported with expert parallelism"
        )
    return layers


def expert_activation(config: Any, fc1: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """Megatron's MLP activation (unfused): gated or not, clamp and linear offset, times the routing
    probability in the probability's precision, back to the activation dtype."""
    if config.gated_linear_unit:
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        act = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        act = config.activation_func(fc1)
    if probs is not None:
        act = (act * probs.unsqueeze(-1)).to(fc1.dtype)
    return act


class LoRAExperts(SequentialMLP):
    """Megatron's ``SequentialMLP`` (same experts, same parameters) run as grouped GEMMs over the
    expert-sorted rows, with each projection's expert LoRA added in one routed pass.

    Set by :func:`inject_moe`: ``lora`` (``linear_fc1`` / ``linear_fc2`` -> the projection's
    :class:`MultiLoRAExpertLinear`, when a target), ``row_slots`` (the rows' slots, set by the MoE
    layer around each call)."""

    lora: nn.ModuleDict
    row_slots: torch.Tensor | None

    def _linears(self, proj: str) -> list[nn.Module]:
        return [getattr(expert, proj) for expert in self.local_experts]

    def stacked(self, proj: str, name: str = "weight") -> torch.Tensor | None:
        """The local experts' ``proj`` parameter ``name`` as one ``[E, ...]`` tensor (made once; again
        after the parameters were moved)."""
        cache = self.__dict__.setdefault("_stacks", {})
        linears = self._linears(proj)
        if getattr(linears[0], name, None) is None:
            return None
        if not holds(cache.get((proj, name)), linears, name):
            cache[(proj, name)] = stack_weights(linears, name)
        return cache[(proj, name)]

    def lora_layer(self, proj: str) -> MultiLoRAExpertLinear | None:
        lora = getattr(self, "lora", None)
        return lora[proj] if lora is not None and proj in lora else None

    def project(
        self,
        proj: str,
        x: torch.Tensor,
        counts: list[int] | None,
        offsets: torch.Tensor | None,
        row_experts: torch.Tensor,
        probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One projection's base GEMMs over expert-sorted rows (plus its bias: fc2's times ``probs``)."""
        out = grouped_linear(x, self.stacked(proj), counts, offsets, row_experts)
        bias = self.stacked(proj, "bias")
        if bias is not None:
            rows = bias.index_select(0, row_experts)
            out = out + (rows if probs is None else rows * probs.unsqueeze(-1)).to(out.dtype)
        return out

    def forward(  # type: ignore[override]
        self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        cfg = self.config
        if cfg.moe_apply_probs_on_input:
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        counts = [int(c) for c in tokens_per_expert.tolist()]
        device = hidden.device
        row_experts = torch.repeat_interleave(
            torch.arange(len(counts), device=device),
            torch.tensor(counts, device=device),
            output_size=hidden.shape[0],
        )
        offsets = None
        if hidden.is_cuda:
            offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        fc1_lora, fc2_lora = self.lora_layer("linear_fc1"), self.lora_layer("linear_fc2")
        plan = None
        if fc1_lora is not None or fc2_lora is not None:
            any_lora = fc1_lora if fc1_lora is not None else fc2_lora
            assert self.row_slots is not None, "the MoE layer sets the rows' slots"
            shared = fc1_lora is not None and fc1_lora.shared_a
            plan = build_expert_plan(self.row_slots, counts, any_lora.num_slots, any_lora.order, shared)
        fc1 = self.project("linear_fc1", hidden, counts, offsets, row_experts)
        if fc1_lora is not None:
            fc1 = fc1_lora.add_lora(hidden, fc1, plan)
        act = expert_activation(cfg, fc1, probs)
        out = self.project("linear_fc2", act, counts, offsets, row_experts, probs)
        if fc2_lora is not None:
            out = fc2_lora.add_lora(act, out, ExpertPlan(plan.groups))
        return out, None


class MultiLoRAMoELayer(MoELayer):
    """Megatron's ``MoELayer`` whose tokens carry their slot ids through routing, dispatch and experts.

    The forward composes Megatron's own steps (route, dispatch, experts, combine); it differs in
    carrying the slots and, under TP with expert parallelism, in routing only this TP rank's share
    of the tokens (Megatron refuses TP without sequence parallelism in training instead)."""

    experts: LoRAExperts

    def expert_lora(self) -> list[MultiLoRAExpertLinear]:
        return [layer for proj in EXPERT_PROJECTIONS if (layer := self.experts.lora_layer(proj)) is not None]

    def _splits_tokens(self) -> bool:
        """Whether this TP rank routes only its share of the tokens: when the dispatcher would
        otherwise gather the TP ranks' identical tokens (expert parallelism under TP)."""
        return self.tp_group.size() > 1 and self.token_dispatcher.ep_size > 1

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, intermediate_tensors: Any = None, padding_mask: Any = None
    ) -> tuple[torch.Tensor, None]:
        if intermediate_tensors is not None:
            raise ConfigError(
                "model.cuda_graph_scope", "partial CUDA graphs of the MoE layer are not supported"
            )
        shape, hidden = hidden_states.shape, hidden_states.shape[-1]
        x = hidden_states.reshape(-1, hidden)
        lora = self.expert_lora()
        slots = token_slot_ids(lora[0].routing, x.shape[0]) if lora else None
        tokens = x.shape[0]
        split = self._splits_tokens()
        if split:
            if padding_mask is not None:
                raise ConfigError("padding_mask", "is not supported with expert parallelism under TP")
            x, slots = self._my_share(x, slots)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        out = self._route_and_compute(x.unsqueeze(1), slots, padding_mask).reshape(-1, hidden)
        if split:
            out = gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False, group=self.tp_group
            )[:tokens]
        return self.add_shared_expert(out.view(shape), hidden_states), None

    def add_shared_expert(self, routed: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``routed`` plus the shared expert's output on every token (its LoRA routed like a dense
        MLP's), as Megatron's ``postprocess`` adds it; ``routed`` alone without a shared expert."""
        shared = self.shared_experts_compute(hidden_states)
        return routed if shared is None else routed + shared

    def _my_share(
        self, x: torch.Tensor, slots: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This TP rank's contiguous share of the tokens (padded with base-only zero rows to a
        multiple of the TP size); the backward gathers the shares' gradients."""
        size, rank = self.tp_group.size(), self.tp_group.rank()
        pad = -x.shape[0] % size
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            if slots is not None:
                slots = torch.cat([slots, slots.new_full((pad,), -1)])
        x = scatter_to_sequence_parallel_region(x, group=self.tp_group)
        if slots is not None:
            slots = slots.chunk(size)[rank]
        return x, slots

    def _route_and_compute(
        self, x: torch.Tensor, slots: torch.Tensor | None, padding_mask: Any
    ) -> torch.Tensor:
        dispatcher = self.token_dispatcher
        probs, routing_map = self.route(x, padding_mask)
        hidden, probs = self.preprocess(x, probs, routing_map)
        if slots is not None:
            slots = expert_dispatch.after_preprocess(dispatcher, slots)
        hidden, probs = self.dispatch(hidden, probs)
        if slots is not None:
            slots = expert_dispatch.after_dispatch(dispatcher, slots)
        rows, tokens_per_expert, rows_probs = dispatcher.dispatch_postprocess(hidden, probs)
        if slots is not None:
            slots = expert_dispatch.after_postprocess(dispatcher, slots)
        self.experts.row_slots = slots
        try:
            out, _ = self.experts(rows, tokens_per_expert, rows_probs)
        finally:
            self.experts.row_slots = None
        out = self.combine(dispatcher.combine_preprocess(out))
        return self.postprocess(out, None)


def _expert_dp_group(expert_parallel: bool) -> Any:
    """The replicas of a rank's experts that see other tokens, over which the experts' LoRA gradients
    are summed: without expert parallelism every TP rank runs the MoE layer on the same tokens, so
    that is the data-parallel group (the dense layers'); with it, Megatron's expert-data-parallel
    group (the TP ranks route their own shares of the tokens)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if expert_parallel:
        return parallel_state.get_expert_data_parallel_group(check_initialized=False)
    return parallel_state.get_data_parallel_group()


def inject_moe(
    model: nn.Module,
    targets: tuple[str, ...],
    num_slots: int,
    max_rank: int,
    kernels: str = "auto",
    shared_expert_a: bool = False,
    order: str = SLOT_MAJOR,
    expert_rank_scaling: bool = False,
) -> list[MultiLoRAExpertLinear]:
    """Make every MoE layer of ``model`` a :class:`MultiLoRAMoELayer` (validated first: on error
    nothing changed) with expert LoRA on the ``targets`` among fc1/fc2. ``shared_expert_a``: fc1's
    ``A`` is one per slot for all experts (its ``B`` stays per expert); ``expert_rank_scaling``: a
    fresh slot's routed experts get its rank divided by the layer's top-k (``rank_divisor``).
    Returns the new layers."""
    layers = validate_moe(model, shared_expert_a)
    new: list[MultiLoRAExpertLinear] = []
    for moe in layers:
        experts = moe.experts
        first = experts.local_experts[0]
        weight = first.linear_fc1.weight
        lora = nn.ModuleDict()
        for proj in EXPERT_PROJECTIONS:
            if proj not in targets:
                continue
            out_f, in_f = getattr(first, proj).weight.shape
            lora[proj] = MultiLoRAExpertLinear(
                proj,
                in_f,
                out_f,
                moe.num_local_experts,
                num_slots,
                max_rank,
                key=f"layers.{int(moe.layer_number) - 1}.experts.{proj}",
                config=moe.config,
                expert_offset=moe.local_expert_indices[0],
                num_experts=moe.config.num_moe_experts,
                shared_a=shared_expert_a and proj == "linear_fc1",
                order=order,
                rank_divisor=moe.config.moe_router_topk if expert_rank_scaling else 1,
                kernels=kernels,
                ep_group=moe.ep_group if moe.token_dispatcher.ep_size > 1 else None,
                expert_dp_group=_expert_dp_group(moe.token_dispatcher.ep_size > 1),
                device=weight.device,
                dtype=weight.dtype,
            )
            new.append(lora[proj])
        as_lora_moe(moe, lora)
    return new


def as_lora_moe(moe: MoELayer, lora: nn.ModuleDict | None = None) -> MultiLoRAMoELayer:
    """``moe`` as a :class:`MultiLoRAMoELayer` (in place: same modules and parameters) whose experts
    hold the expert LoRA layers ``lora`` (none: base only) and their weights as grouped-GEMM stacks."""
    experts = moe.experts
    moe.__class__ = MultiLoRAMoELayer
    experts.__class__ = LoRAExperts
    experts.lora = lora if lora is not None else nn.ModuleDict()
    experts.row_slots = None
    for proj in EXPERT_PROJECTIONS:
        experts.stacked(proj)
        experts.stacked(proj, "bias")
    return moe  # type: ignore[return-value]
