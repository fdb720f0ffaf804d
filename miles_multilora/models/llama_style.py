"""What every Llama-style decoder bridge of this package shares (RMSNorm, RoPE, GQA, SwiGLU,
untied): the provider's settings and the names of the embedding, norm and attention weights."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

LAYER = "decoder.layers.*"
HF_LAYER = "model.layers.*"


def llama_style(provider: Any, qkv_bias: bool) -> Any:
    """``provider`` set up as a Llama-style decoder (biases on q/k/v only when ``qkv_bias``)."""
    provider.normalization = "RMSNorm"
    provider.gated_linear_unit = True
    provider.activation_func = F.silu
    provider.position_embedding_type = "rope"
    provider.add_bias_linear = False
    provider.add_qkv_bias = qkv_bias
    provider.qk_layernorm = False
    return provider


def dense_names() -> dict[str, str]:
    """Megatron name -> HF name of the embedding, the output layer, the norms and the attention
    output projection (the fused q/k/v weight needs a ``QKVMapping`` of its own)."""
    return {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "output_layer.weight": "lm_head.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        f"{LAYER}.self_attention.linear_qkv.layer_norm_weight": f"{HF_LAYER}.input_layernorm.weight",
        f"{LAYER}.pre_mlp_layernorm.weight": f"{HF_LAYER}.post_attention_layernorm.weight",
        f"{LAYER}.self_attention.linear_proj.weight": f"{HF_LAYER}.self_attn.o_proj.weight",
    }
