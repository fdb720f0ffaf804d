"""Test helpers for mixture-of-experts models: tiny Megatron MoE GPTs with multi-LoRA, tiny random
HF MoE checkpoints (Qwen3-MoE, Mixtral) and a plain-torch reference of one MoE layer with expert LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_multilora.testing.lora import TINY_GPT_SIZES

MOE_SIZES = dict(
    TINY_GPT_SIZES,
    max_seq_len=64,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=24,
)


def tiny_moe_gpt(
    num_slots: int = 3,
    max_rank: int = 4,
    seed: int = 0,
    kernels: str = "auto",
    shared_expert_a: bool = False,
    order: str = "slot_major",
    expert_rank_scaling: bool = False,
    dispatcher: str = "allgather",
    targets: Any = "all-linear",
    tp: int = 1,
    ep: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    lora: bool = True,
    **sizes: Any,
) -> torch.nn.Module:
    """A tiny CPU MoE GPTModel (the provider's) with MultiLoRA on attention and the experts' fc1/fc2.
    With ``rank`` set, this process is that rank of a ``world_size``-process group (CPU init draws
    every full weight from one seed, so every TP/EP layout builds the same model)."""
    from miles_multilora.lora import apply_multi_lora
    from miles_multilora.models import compat
    from miles_multilora.models.provider import build_tiny_gpt

    compat.init_distributed(tp=tp, pp=1, seed=0, rank=rank, world_size=world_size, ep=ep)
    model = build_tiny_gpt(seed=seed, moe_token_dispatcher=dispatcher, **{**MOE_SIZES, **sizes})
    if lora:
        apply_multi_lora(
            model,
            targets,
            num_slots=num_slots,
            max_rank=max_rank,
            kernels=kernels,
            shared_expert_a=shared_expert_a,
            expert_routing=order,
            expert_rank_scaling=expert_rank_scaling,
        )
    return model


def randomize_b(model: torch.nn.Module, slot: int, seed: int, scale: float = 0.1) -> None:
    """Random ``B`` within the slot's rank in every layer (``init_slot`` leaves ``B = 0``); an expert
    layer's experts are drawn as global experts, so every expert-parallel layout gets the same."""
    from miles_multilora.lora import multi_lora_layers
    from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in multi_lora_layers(model):
            r = layer.slot_rank[slot]
            b = layer.lora_B[slot][..., :r]
            if isinstance(layer, MultiLoRAExpertLinear):
                full = scale * torch.randn(layer.num_experts, *b.shape[1:], generator=gen)
                b.copy_(full[layer.expert_offset : layer.expert_offset + layer.num_local_experts])
            else:
                b.copy_(scale * torch.randn(b.shape, generator=gen))


def tiny_moe_hf_model(arch: str = "qwen3_moe", seed: int = 0, norm_topk_prob: bool = True) -> Any:
    """A randomly initialised tiny HF Qwen3-MoE (qk-norm, every layer sparse), Mixtral or Qwen2-MoE
    (q/k/v biases, a gated shared expert beside the routed ones) causal LM."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    dims = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**dims, intermediate_size=24, num_local_experts=4)).eval()
    if arch == "qwen2_moe":
        config = Qwen2MoeConfig(
            **dims,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model = Qwen2MoeForCausalLM(config)
        with torch.no_grad():  # HF zero-inits biases: random ones so that the mapping is checked
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0.0, 0.1)
        return model.eval()
    config = Qwen3MoeConfig(
        **dims,
        head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_experts=4,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return Qwen3MoeForCausalLM(config).eval()


def make_tiny_moe_checkpoint(out_dir: str | Path, arch: str = "qwen3_moe", seed: int = 0, **kw: Any) -> Path:
    out_dir = Path(out_dir)
    tiny_moe_hf_model(arch, seed, **kw).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def reference_moe(moe: Any, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """One MoE layer with expert LoRA, token by token in plain torch (independent of the dispatcher,
    the grouped GEMMs and the routed kernels): ``x`` ``[N, H]``, ``token_slots`` ``[N]`` -> ``[N, H]``.

    Each token's chosen experts come from the layer's own router; expert ``e`` of slot ``s`` adds
    ``scale_s * B_{s,e} A_{s,e}`` to fc1 and fc2 (fc2's input is the activation times the routing
    weight, as in Megatron), weights read from the layer's parameters (gradients flow to them)."""
    experts = moe.experts
    cfg = moe.config
    probs, routing_map = moe.router(x.unsqueeze(1))
    lora = {p: experts.lora_layer(p) for p in ("linear_fc1", "linear_fc2")}
    outs = []
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        y = torch.zeros_like(x[t])
        for e in routing_map[t].nonzero().flatten().tolist():
            mlp = experts.local_experts[e]
            h = x[t] @ mlp.linear_fc1.weight.t()
            if lora["linear_fc1"] is not None and s >= 0:
                layer = lora["linear_fc1"]
                a = layer.lora_A[s, 0 if layer.shared_a else e]
                h = h + layer.lora_scale[s] * (layer.lora_B[s, e] @ (a @ x[t]))
            gate, up = h.chunk(2)
            act = cfg.activation_func(gate) * up * probs[t, e]
            o = act @ mlp.linear_fc2.weight.t()
            if lora["linear_fc2"] is not None and s >= 0:
                layer = lora["linear_fc2"]
                o = o + layer.lora_scale[s] * (layer.lora_B[s, e] @ (layer.lora_A[s, e] @ act))
            y = y + o
        outs.append(y)
    return torch.stack(outs)
