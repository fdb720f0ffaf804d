"""Each token's slot id travels with the token through Megatron's MoE token dispatcher.

The dispatcher permutes, gathers and exchanges the hidden states in three steps (preprocess,
dispatch, postprocess) and keeps what it did on itself (permutation indices, split sizes). After
each step the slot ids ``[rows]`` (long) take the same path, read from that state: the same
permutation, the same all-gather over the tensor-and-expert-parallel group (all-gather
dispatcher), the same all-to-all over the expert-parallel group and the same sort of the received
chunks by local expert (all-to-all dispatcher). The expert rows' slots then line up with the rows
the experts get, on every rank. Slot ids carry no gradient.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import all_to_all, gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoETokenDispatcher,
)

from miles_multilora.errors import ConfigError

DISPATCHERS = (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)


def check_dispatcher(dispatcher: MoETokenDispatcher) -> None:
    """Refuse a dispatcher whose token path the slot ids cannot follow (flex/DeepEP, padded capacity)."""
    if type(dispatcher) not in DISPATCHERS:
        raise ConfigError(
            "model.moe_token_dispatcher_type",
            f"{type(dispatcher).__name__} is not supported with expert LoRA: use 'allgather' or 'alltoall'",
        )
    if getattr(dispatcher, "drop_and_pad", False):
        raise ConfigError(
            "model.moe_pad_expert_input_to_capacity", "padding experts to capacity is not supported"
        )


def after_preprocess(dispatcher: MoETokenDispatcher, slots: torch.Tensor) -> torch.Tensor:
    """The all-to-all dispatcher sorted the tokens by expert (one row per token and chosen expert)."""
    if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        return slots.index_select(0, dispatcher.reversed_local_input_permutation_mapping)
    return slots


def after_dispatch(dispatcher: MoETokenDispatcher, slots: torch.Tensor) -> torch.Tensor:
    """The communication: all-gather over TP x EP, or all-to-all over EP with the dispatcher's splits."""
    if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        return all_to_all(dispatcher.ep_group, slots, dispatcher.output_splits, dispatcher.input_splits)
    if dispatcher.tp_size > 1 or dispatcher.ep_size > 1:
        return gather_from_sequence_parallel_region(slots, group=dispatcher.tp_ep_group)
    return slots


def after_postprocess(dispatcher: MoETokenDispatcher, slots: torch.Tensor) -> torch.Tensor:
    """The rows of the local experts, sorted by expert: as the dispatcher sorted the hidden states."""
    if isinstance(dispatcher, MoEAllGatherTokenDispatcher):
        return slots.index_select(0, dispatcher.reversed_local_input_permutation_mapping)
    if dispatcher.tp_size > 1:
        sizes = None if dispatcher.output_splits_tp is None else dispatcher.output_splits_tp.tolist()
        slots = gather_from_sequence_parallel_region(
            slots, group=dispatcher.tp_group, output_split_sizes=sizes
        )
    if dispatcher.num_local_experts > 1:
        slots, _ = sort_chunks_by_idxs(
            slots,
            dispatcher.num_global_tokens_per_local_expert.ravel(),
            dispatcher.sort_input_by_local_experts,
            fused=False,
        )
    return slots
