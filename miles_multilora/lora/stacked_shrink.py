"""The LoRA shrink of a decode step as extra output columns of the base GEMM.

At many rows per step (512) the base GEMMs are large and a separate LoRA shrink kernel is pure
latency (~4.5 us per call on an H100 for ~3 MB). Instead, every slot's ``lora_A`` rows are stacked
under the base weight in one buffer ``[out + slots * R, in]``: one GEMM ``x @ stacked^T`` gives
the base output (its first ``out`` columns) and every slot's unscaled shrink ``x @ A^T`` (the
rest), the dense shrink the expand kernels already read (``dense_scale``).

The base weight becomes a view of the top rows, so its memory is not doubled and the trainer keeps
using it as before; the buffer's ``lora_A`` rows are a copy that :func:`sync_stacked` refreshes
before every generation (optimizer steps and slot loads write ``lora_A`` in place, which the copy
does not see by itself). Only for single-rank layers without a bias, while the extra columns stay
a small part of the GEMM (``MAX_EXTRA_FRACTION``); the engine stacks on CUDA only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles_multilora.lora.layer import MultiLoRALinear

# A layer whose slots' A rows would add more than this fraction to its base GEMM's output columns
# keeps the separate shrink kernel (16 slots of rank 16 add 2-12% to a 2.1 B model's linears).
MAX_EXTRA_FRACTION = 0.25


def stackable(layer: MultiLoRALinear) -> bool:
    """Whether ``layer``'s base weight can carry its slots' A rows (see the module docstring; the
    caller decides on the device: only decode steps with the Triton kernels read the stack)."""
    if not layer.stacks_shrink:
        return False
    weight = layer.base.weight
    extra = layer.num_slots * layer.max_rank
    return (
        layer.kernels != "torch"
        and layer.tp_size == 1
        and getattr(layer.base, "bias", None) is None
        and weight.dtype == layer.lora_A.dtype
        and extra <= MAX_EXTRA_FRACTION * layer.out_features
    )


def _stack(layer: MultiLoRALinear) -> torch.Tensor:
    weight = layer.base.weight
    out_f, in_f = weight.shape
    stacked = torch.empty(
        out_f + layer.num_slots * layer.max_rank, in_f, dtype=weight.dtype, device=weight.device
    )
    stacked[:out_f].copy_(weight.detach())
    layer.base.weight.data = stacked[:out_f]  # the old storage is freed unless something else holds it
    return stacked


def sync_stacked(layers: Iterable[MultiLoRALinear]) -> int:
    """Give every stackable layer its stacked weight (once; again if its base weight moved, e.g.
    after ``model.to``) and copy its current ``lora_A`` into it. Returns how many layers have one."""
    count = 0
    with torch.no_grad():
        for layer in layers:
            stacked = layer.current_stack()
            if stacked is None:  # none yet, or the base weight was reallocated since
                layer.stacked_weight = None
                if not stackable(layer):
                    continue
                stacked = layer.stacked_weight = _stack(layer)
            stacked[layer.out_features :].copy_(layer.lora_A.detach().reshape(-1, layer.in_features))
            count += 1
    return count


def unstack(layers: Iterable[MultiLoRALinear]) -> int:
    """Give every stacked layer a base weight of its own again and drop its stack (A/B runs, or to
    free the copy of ``lora_A``; the next :func:`sync_stacked` stacks again). Returns how many."""
    count = 0
    with torch.no_grad():
        for layer in layers:
            if layer.stacked_weight is None:
                continue
            stacked = layer.current_stack()
            if stacked is not None:  # a stale stack no longer holds the base weight
                layer.base.weight.data = stacked[: layer.out_features].clone()
            layer.stacked_weight = None
            count += 1
    return count
