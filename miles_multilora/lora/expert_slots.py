"""Slot operations on expert LoRA layers: fresh init, PEFT module names, export and load.

The PEFT layout of expert LoRA is one LoRA per expert and projection, as PEFT makes it for an HF
MoE whose experts are ``nn.Linear`` modules (transformers 4.x) and as vLLM (>= 0.11.2, its fused-MoE
LoRA) loads it: ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`` (Qwen3-MoE, Qwen2-MoE,
OLMoE) or ``model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}`` (Mixtral). Names are kept
in the Qwen3-MoE form here; :func:`hf_name` / :func:`canonical_name` convert for Mixtral. A shared
expert's LoRA (dense layers, :mod:`~miles_multilora.lora.layout`) is named
``model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj`` (Qwen2-MoE); these two convert it to
DeepSeek's and GLM's ``mlp.shared_experts``.

A slot's experts share its rank and scale. Export writes every expert's gate and up with the
expert's one fc1 ``A``, at the slot's rank and alpha; a PEFT adapter whose gate and up have
distinct ``A`` matrices loads with them stacked (rank 2r), as the dense fused layers do.
Collective over the expert-parallel group: each rank holds its local experts.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist

from miles_multilora.errors import SpecError
from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from miles_multilora.lora.peft_parts import fuse_parts

_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_FROM_MIXTRAL = {v: k for k, v in _MIXTRAL.items()}


def _layer_index(layer: MultiLoRAExpertLinear) -> int:
    return int(layer.key.split(".")[1])  # "layers.{i}.experts.{proj}"


def expert_module_names(layer: MultiLoRAExpertLinear, expert: int) -> list[str]:
    """HF module names (Qwen3-MoE form, no PEFT prefix) of global ``expert``'s projection, in row order."""
    base = f"model.layers.{_layer_index(layer)}.mlp.experts.{expert}"
    if layer.proj == "linear_fc2":
        return [f"{base}.down_proj"]
    gated = bool(getattr(layer.config, "gated_linear_unit", True))
    return [f"{base}.gate_proj", f"{base}.up_proj"] if gated else [f"{base}.up_proj"]


def all_module_names(layer: MultiLoRAExpertLinear) -> list[str]:
    """Every expert's module names (all EP ranks' experts)."""
    return [n for e in range(layer.num_experts) for n in expert_module_names(layer, e)]


def local_experts(layer: MultiLoRAExpertLinear) -> range:
    return range(layer.expert_offset, layer.expert_offset + layer.num_local_experts)


def part_rows(layer: MultiLoRAExpertLinear) -> list[int]:
    n = len(expert_module_names(layer, 0))
    return [layer.out_features // n] * n


_SHARED_QWEN, _SHARED_PLURAL = ".mlp.shared_expert.", ".mlp.shared_experts."
# architectures whose shared expert MLP is ``mlp.shared_experts`` (megatron-bridge's DeepSeek and GLM
# mappings); Qwen2-MoE / Qwen3-Next name it ``mlp.shared_expert`` (the canonical form here)
_PLURAL_SHARED_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe")


def _model_type(hf_config: Any) -> str | None:
    if isinstance(hf_config, dict):
        return hf_config.get("model_type")
    return getattr(hf_config, "model_type", None)


def hf_name(name: str, hf_config: Any) -> str:
    """The module's name in the checkpoint's architecture (Mixtral: ``block_sparse_moe`` and w1/w3/w2;
    DeepSeek and GLM: ``mlp.shared_experts`` for the shared expert)."""
    model_type = _model_type(hf_config)
    if model_type in _PLURAL_SHARED_TYPES:
        return name.replace(_SHARED_QWEN, _SHARED_PLURAL)
    if model_type != "mixtral" or ".mlp.experts." not in name:
        return name
    head, leaf = name.rsplit(".", 1)
    return f"{head.replace('.mlp.experts.', '.block_sparse_moe.experts.')}.{_MIXTRAL.get(leaf, leaf)}"


def canonical_name(name: str) -> str:
    """Inverse of :func:`hf_name` (names of other modules are returned unchanged)."""
    name = name.replace(_SHARED_PLURAL, _SHARED_QWEN)
    if ".block_sparse_moe.experts." not in name:
        return name
    head, leaf = name.rsplit(".", 1)
    return f"{head.replace('.block_sparse_moe.experts.', '.mlp.experts.')}.{_FROM_MIXTRAL.get(leaf, leaf)}"


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_a(layer: MultiLoRAExpertLinear, rank: int, seed: int) -> torch.Tensor:
    """Fresh ``A`` of this rank's experts ``[E or 1, rank, in]``: kaiming-uniform as PEFT, one CPU
    generator per global expert (the same whatever the expert parallelism)."""
    bound = 1.0 / math.sqrt(layer.in_features)
    keys = [layer.key] if layer.shared_a else [f"{layer.key}.{e}" for e in local_experts(layer)]
    out = torch.empty(len(keys), rank, layer.in_features, dtype=torch.float32)
    for i, key in enumerate(keys):
        out[i].uniform_(-bound, bound, generator=_generator(seed, key))
    return out


@torch.no_grad()
def export_layer(
    layer: MultiLoRAExpertLinear, slot: int, rslora: bool
) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """``(HF name, A, B, alpha)`` of every expert module of the slot, all experts of every EP rank."""
    rank, scale = layer.slot_rank[slot], layer.slot_scale[slot]
    alpha = scale * (math.sqrt(rank) if rslora else rank)
    a_all = layer.lora_A[slot, :, :rank].detach().cpu()
    b_all = layer.lora_B[slot, :, :, :rank].detach().cpu()
    out = []
    for i, expert in enumerate(local_experts(layer)):
        a = a_all[0 if layer.shared_a else i]
        blocks = b_all[i].split(part_rows(layer), dim=0)
        for name, b in zip(expert_module_names(layer, expert), blocks, strict=True):
            out.append((name, a.contiguous().clone(), b.contiguous().clone(), alpha))
    if layer.ep_group is not None and dist.get_world_size(layer.ep_group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(layer.ep_group)
        dist.all_gather_object(gathered, out, group=layer.ep_group)
        out = [item for part in gathered for item in part]
    return out


def fuse_layer(
    layer: MultiLoRAExpertLinear,
    found: dict[str, dict[str, torch.Tensor]],
    modules: dict[str, tuple[int, float]],
    rslora: bool,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This rank's experts' ``A`` ``[E or 1, rank, in]`` and ``B`` ``[E, out, rank]`` and the slot's
    scale from the PEFT modules ``found`` (canonical names; other ranks' experts are ignored).
    Experts missing from the adapter get no LoRA; every expert is brought to the largest rank."""
    fused = {}
    for expert in local_experts(layer):
        names = expert_module_names(layer, expert)
        if any(n in found for n in names):
            fused[expert] = fuse_parts(
                layer.key, names, part_rows(layer), layer.in_features, layer.max_rank, found, modules, rslora
            )
    rank = max((a.shape[0] for a, _, _, _ in fused.values()), default=0)
    scale = next(iter(fused.values()))[2] if fused else 0.0
    a_out = torch.zeros(layer.num_local_experts, rank, layer.in_features)
    b_out = torch.zeros(layer.num_local_experts, layer.out_features, rank)
    for i, expert in enumerate(local_experts(layer)):
        if expert not in fused:
            continue
        a, blocks, expert_scale, _ = fused[expert]
        b = torch.cat(blocks, dim=0)
        if expert_scale != scale:  # one scale per slot: fold the ratio into this expert's B
            b = (b.double() * (expert_scale / scale)).to(b.dtype)
        a_out[i, : a.shape[0]] = a
        b_out[i, :, : a.shape[0]] = b
    if layer.shared_a:
        if any(not torch.equal(a_out[i], a_out[0]) for i in range(1, layer.num_local_experts)):
            raise SpecError(
                "lora.shared_expert_a",
                f"{layer.key}: the adapter has a different lora_A per expert, which a shared expert A "
                "cannot hold; set lora.shared_expert_a=false",
            )
        a_out = a_out[:1]
    return a_out, b_out, scale
