"""How a MultiLoRA layer's fused Megatron rows map to HF/PEFT modules, and how TP shards them.

Canonical (TP-gathered) layouts:

* ``linear_qkv``: Megatron's fused rows, per query group ``[q heads of the group; k; v]``.
* ``linear_fc1`` (SwiGLU): ``[gate; up]``; each TP rank holds ``[gate shard; up shard]`` (an MoE
  layer's shared expert alike, under ``mlp.shared_expert``).
* ``linear_proj`` / ``linear_fc2`` / ``output_layer``: one HF module each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles_multilora.lora.layer import COLUMN, ROW, MultiLoRALinear

HF_PREFIX = "base_model.model."
_ATTN, _MLP = "self_attn", "mlp"


def leaf(layer: MultiLoRALinear) -> str:
    return layer.key.rsplit(".", 1)[-1]


def _layer_index(layer: MultiLoRALinear) -> int | None:
    """``layers.{i}.{leaf}`` (or an MoE layer's shared expert, ``layers.{i}.shared_experts.{leaf}``) -> i."""
    parts = layer.key.split(".")
    shared = len(parts) == 4 and parts[2] == "shared_experts"
    return int(parts[1]) if (len(parts) == 3 or shared) and parts[0] == "layers" else None


def _mlp(layer: MultiLoRALinear) -> str:
    """The HF module holding the layer's MLP projections: ``mlp``, or a shared expert's
    ``mlp.shared_expert`` (Qwen2-MoE's name; :func:`~miles_multilora.lora.expert_slots.hf_name`
    gives other architectures theirs)."""
    return f"{_MLP}.shared_expert" if ".shared_experts." in layer.key else _MLP


def _gated(layer: MultiLoRALinear) -> bool:
    return bool(getattr(getattr(layer.base, "config", None), "gated_linear_unit", False))


def hf_parts(layer: MultiLoRALinear) -> list[str]:
    """HF module names (without the PEFT prefix) whose LoRA this layer holds, in row order."""
    idx, name = _layer_index(layer), leaf(layer)
    if idx is None:
        return ["lm_head"] if name == "output_layer" else [layer.key]
    base = f"model.layers.{idx}"
    table = {
        "linear_qkv": [f"{base}.{_ATTN}.{p}" for p in ("q_proj", "k_proj", "v_proj")],
        "linear_proj": [f"{base}.{_ATTN}.o_proj"],
        "linear_fc1": [f"{base}.{_mlp(layer)}.{p}" for p in ("gate_proj", "up_proj")]
        if _gated(layer)
        else [f"{base}.{_mlp(layer)}.up_proj"],
        "linear_fc2": [f"{base}.{_mlp(layer)}.down_proj"],
    }
    return table.get(name, [f"{base}.{name}"])


def _qkv_dims(layer: MultiLoRALinear) -> tuple[int, int, int]:
    cfg = layer.base.config
    groups = cfg.num_query_groups or cfg.num_attention_heads
    head_dim = cfg.kv_channels
    return groups, cfg.num_attention_heads // groups, head_dim


def split_rows(layer: MultiLoRALinear, b_full: torch.Tensor) -> list[torch.Tensor]:
    """Canonical full ``B`` rows -> one block of rows per entry of :func:`hf_parts`."""
    parts = hf_parts(layer)
    if len(parts) == 1:
        return [b_full]
    if leaf(layer) == "linear_fc1":
        return list(b_full.chunk(2, dim=0))
    groups, per_group, d = _qkv_dims(layer)
    grouped = b_full.reshape(groups, (per_group + 2) * d, -1)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return [t.reshape(-1, b_full.shape[-1]) for t in (q, k, v)]


def part_rows(layer: MultiLoRALinear) -> list[int]:
    """Number of output rows of each HF part (full, unsharded)."""
    parts = hf_parts(layer)
    if len(parts) == 1:
        return [layer.full_out_features]
    if leaf(layer) == "linear_fc1":
        return [layer.full_out_features // 2] * 2
    groups, per_group, d = _qkv_dims(layer)
    return [groups * per_group * d, groups * d, groups * d]


def join_rows(layer: MultiLoRALinear, blocks: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`split_rows`."""
    if len(blocks) == 1:
        return blocks[0]
    if leaf(layer) == "linear_fc1":
        return torch.cat(blocks, dim=0)
    groups, per_group, d = _qkv_dims(layer)
    q, k, v = (b.reshape(groups, -1, b.shape[-1]) for b in blocks)
    return torch.cat([q, k, v], dim=1).reshape(-1, blocks[0].shape[-1])


# ----- TP sharding of the canonical layout -----
def fc1_gated(layer: MultiLoRALinear) -> bool:
    """Whether ``layer`` is a gated fc1, its rows ``[gate; up]`` (each half split over TP)."""
    return leaf(layer) == "linear_fc1" and _gated(layer)


def shard_A(layer: MultiLoRALinear, a_full: torch.Tensor) -> torch.Tensor:
    """This rank's ``A`` [r, in_local] from the full [r, in]."""
    if layer.kind == ROW and layer.tp_size > 1:
        return a_full.chunk(layer.tp_size, dim=1)[layer.tp_rank]
    return a_full


def shard_B(layer: MultiLoRALinear, b_full: torch.Tensor) -> torch.Tensor:
    """This rank's ``B`` [out_local, r] from the canonical full [out, r]."""
    if layer.kind != COLUMN or layer.tp_size == 1:
        return b_full
    if fc1_gated(layer):
        gate, up = b_full.chunk(2, dim=0)
        return torch.cat([gate.chunk(layer.tp_size)[layer.tp_rank], up.chunk(layer.tp_size)[layer.tp_rank]])
    return b_full.chunk(layer.tp_size, dim=0)[layer.tp_rank]


def _all_gather(layer: MultiLoRALinear, t: torch.Tensor) -> list[torch.Tensor]:
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(layer.tp_size)]
    dist.all_gather(out, t, group=layer.tp_group)
    return out


def gather_A(layer: MultiLoRALinear, a_local: torch.Tensor) -> torch.Tensor:
    """Full ``A`` [r, in] from this rank's shard (collective over the TP group when row-parallel)."""
    if layer.kind == ROW and layer.tp_size > 1:
        return torch.cat(_all_gather(layer, a_local), dim=1)
    return a_local


def gather_B(layer: MultiLoRALinear, b_local: torch.Tensor) -> torch.Tensor:
    """Canonical full ``B`` [out, r] from this rank's shard (collective when column-parallel)."""
    if layer.kind != COLUMN or layer.tp_size == 1:
        return b_local
    shards = _all_gather(layer, b_local)
    if fc1_gated(layer):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0)
