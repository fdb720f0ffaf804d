"""A saved slot state written into a live slot in a handful of batched copies, not one per tensor.

A slot of a 28-layer model is ~2,000 tensors on a rank (each layer's A and B, their fp32 masters and
Adam moments, gradients, scales). Written one by one (:func:`~miles_multilora.lora.slots.
load_slot_state`, :func:`~miles_multilora.trainer.shard.pad_optimizer`, ``SlotAdamW.
load_slot_state_dict``), each is a zero, a pad and a copy: thousands of small kernel launches, ~30 ms
of exposed restore on an H200 at rank 16. :func:`write_slot_state` checks everything first, then:

1. one ``torch._foreach_zero_`` over the slot rows that the state fills only in part (a layer
   whose saved rank is below ``max_rank``) and over the slot's gradient rows;
2. sources on the CPU for a CUDA slot are packed into one flat buffer per dtype and copied to the
   device in one transfer each (views of it become the sources);
3. one ``torch._foreach_copy_`` of every source into its destination: the whole slot row of a
   tensor saved at full rank (contiguous, the fused multi-tensor kernel), or the leading block of
   one cut to a lower rank (an ``A``-shaped block is contiguous too; a ``B``-shaped one,
   ``[out, :rank]``, is strided and copies on its own inside the call);
4. fp32 masters a state lacks are re-read from the written weights in a second call.

The result is bit for bit what the per-tensor path writes (zeros past each layer's rank, the saved
values below it), which ``tests/unit/test_slot_offload.py`` and ``tests/e2e/test_adapter_turns.py``
check through host memory and disk.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from miles_multilora.errors import ConfigError
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.lora.peft_parts import SlotShape
from miles_multilora.lora.slots import _check_slot, _shapes
from miles_multilora.optim.slot_adamw import SlotAdamW, fits_block


class _Plan:
    """Destinations to zero, then (destination, source) pairs to copy."""

    def __init__(self) -> None:
        self.zero: list[torch.Tensor] = []
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []

    def put(self, full: torch.Tensor, src: torch.Tensor) -> None:
        """``src`` into the leading block of ``full`` (one slot's row), the rest zero."""
        if tuple(src.shape) == tuple(full.shape):
            self.dst.append(full)
        else:
            self.zero.append(full)
            if src.numel() == 0:
                return
            self.dst.append(full[tuple(slice(0, n) for n in src.shape)])
        self.src.append(src)


def _to_device(src: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``src`` with the CPU tensors moved to CUDA ``device`` in one transfer per dtype."""
    groups: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(src):
        if t.device.type == "cpu":
            groups[t.dtype].append(i)
    out = list(src)
    for idx in groups.values():
        flat = torch.cat([src[i].reshape(-1) for i in idx])
        # pageable (pinning a fresh block costs more than it saves): CUDA stages it before returning,
        # and non_blocking spares the stream synchronisation a blocking copy ends with
        on_device = flat.to(device, non_blocking=True)
        offset = 0
        for i in idx:
            n = src[i].numel()
            out[i] = on_device[offset : offset + n].view(src[i].shape)
            offset += n
    return out


def _buckets(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pairs grouped so that each group can take the fused multi-tensor kernel: one dtype pair,
    and both sides contiguous (a strided pair, a ``B`` block cut to a lower rank, goes with the
    other strided ones, where the call copies them one by one)."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for d, s in zip(dst, src, strict=True):
        groups[(d.dtype, s.dtype, d.is_contiguous() and s.is_contiguous())].append((d, s))
    return list(groups.values())


@torch.no_grad()
def write_slot_state(
    model: torch.nn.Module,
    optimizer: SlotAdamW,
    slot: int,
    tensors: Mapping[str, torch.Tensor],
    optim_state: Mapping[str, Any],
    grads: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Put a saved state (:func:`~miles_multilora.lora.slots.slot_state` tensors, optionally cut to
    rank; a ``SlotAdamW.slot_state_dict``, likewise) and the gradients it had accumulated
    (``grads``: parameter name -> one slot's gradient) into ``slot``, exactly; everything is
    checked before anything is written."""
    layers = multi_lora_layers(model)
    _check_slot(layers, slot)
    needed = [f"{la.key}.{part}" for la in layers for part in ("rank", "scale", "lora_A", "lora_B")]
    missing = [k for k in needed if k not in tensors]
    if missing:
        raise ConfigError("slot_state", f"missing {missing[:3]}: the state was saved from another model")
    spec = optimizer.check_slot_state(optim_state, cut=True)
    grads = dict(grads or {})
    unknown = sorted(set(grads) - set(optimizer.names))[:3]
    if unknown:
        raise ConfigError("grads", f"parameter names do not match this model: {unknown}")
    plan = _Plan()
    ranks, scales, shapes = [], [], []
    for layer in layers:
        rank = int(tensors[f"{layer.key}.rank"])
        for which, dim in (("lora_A", -2), ("lora_B", -1)):
            full = getattr(layer, which)[slot]
            saved = tensors[f"{layer.key}.{which}"]
            if saved.shape[dim] > rank:
                saved = saved.narrow(dim, 0, rank)
            if not fits_block(tuple(saved.shape), tuple(full.shape)):
                raise ConfigError(
                    f"slot_state.{layer.key}.{which}",
                    f"shape {tuple(saved.shape)}, expected {tuple(full.shape)}",
                )
            plan.put(full, saved.to(full.dtype) if saved.dtype != full.dtype else saved)
        parts = tensors.get(f"{layer.key}.peft_parts")
        shape = None if parts is None else SlotShape.from_tensors(parts, tensors[f"{layer.key}.peft_rslora"])
        ranks.append(rank)
        scales.append(float(tensors[f"{layer.key}.scale"]) if rank else 0.0)
        shapes.append(shape if rank else None)
    masters_from_weights = []
    for i, (name, p) in enumerate(zip(optimizer.names, optimizer.params, strict=True)):
        plan.put(optimizer.exp_avg[i][slot], optim_state["exp_avg"][name])
        plan.put(optimizer.exp_avg_sq[i][slot], optim_state["exp_avg_sq"][name])
        master = optimizer.master[i]
        if master is not None:
            source = (optim_state.get("master") or {}).get(name)
            if source is None:
                masters_from_weights.append((master[slot], p[slot]))
            else:
                plan.put(master[slot], source)
        if p.grad is not None:
            plan.zero.append(p.grad[slot])
        if name in grads:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            plan.dst.append(p.grad[slot])
            plan.src.append(grads[name])
    # each layer's fp32 scale (rounded once from the exact Python float, as set_slot_scale does)
    plan.dst += [layer.lora_scale[slot : slot + 1] for layer in layers]
    plan.src += list(torch.tensor(scales, dtype=torch.float32).split(1))
    device = layers[0].lora_A.device
    src = _to_device(plan.src, device) if device.type == "cuda" else plan.src
    for group in _buckets(plan.zero, plan.zero):
        torch._foreach_zero_([d for d, _ in group])
    for group in _buckets(plan.dst, src):
        torch._foreach_copy_([d for d, _ in group], [s for _, s in group])
    for group in _buckets(*zip(*masters_from_weights, strict=True)) if masters_from_weights else []:
        torch._foreach_copy_([d for d, _ in group], [s for _, s in group])
    for layer, rank, scale, shape in zip(layers, ranks, scales, shapes, strict=True):
        layer.slot_rank[slot] = rank
        layer.slot_scale[slot] = scale
        _shapes(layer)[slot] = shape
    optimizer.steps[slot] = int(optim_state["step"])
    optimizer.specs[slot] = spec
    optimizer.total_steps[slot] = optim_state.get("total_steps")
