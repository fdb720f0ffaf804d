"""A megatron-bridge bridge for HF ``MixtralForCausalLM`` (megatron-bridge 0.3.1 has none).

Mixtral is a Llama-style decoder (RMSNorm, RoPE, GQA, no biases, untied) whose MLPs are a top-k
mixture of SwiGLU experts (``block_sparse_moe``: router ``gate``, experts' ``w1`` gate, ``w3``
up, ``w2`` down) with a softmax over the chosen experts' logits. The weights map onto
Megatron's local MoE layer with the bridge's own mapping types; importing this module registers
the bridge with ``AutoBridge``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_model import GPTModel

from miles_multilora.models import compat

compat.import_auto_bridge()  # imports megatron-bridge with the compat shims (TE/Triton placeholders)
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry  # noqa: E402
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge  # noqa: E402
from megatron.bridge.models.conversion.param_mapping import (  # noqa: E402
    AutoMapping,
    GatedMLPMapping,
    QKVMapping,
)
from transformers import MixtralForCausalLM  # noqa: E402

_LAYER = "decoder.layers.*"
_HF = "model.layers.*"


@MegatronModelBridge.register_bridge(source=MixtralForCausalLM, target=GPTModel, model_type="mixtral")
class MixtralBridge(MegatronModelBridge):
    """Megatron GPTModel <-> HF Mixtral."""

    def provider_bridge(self, hf_pretrained: Any) -> Any:
        provider = super().provider_bridge(hf_pretrained)
        config = hf_pretrained.config
        provider.normalization = "RMSNorm"
        provider.gated_linear_unit = True
        provider.activation_func = F.silu
        provider.position_embedding_type = "rope"
        provider.add_bias_linear = False
        provider.add_qkv_bias = False
        provider.qk_layernorm = False
        provider.num_moe_experts = config.num_local_experts
        provider.moe_router_topk = config.num_experts_per_tok
        provider.moe_ffn_hidden_size = config.intermediate_size
        provider.moe_router_pre_softmax = False  # softmax over the chosen experts' logits
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        direct = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "output_layer.weight": "lm_head.weight",
            "decoder.final_layernorm.weight": "model.norm.weight",
            f"{_LAYER}.self_attention.linear_qkv.layer_norm_weight": f"{_HF}.input_layernorm.weight",
            f"{_LAYER}.pre_mlp_layernorm.weight": f"{_HF}.post_attention_layernorm.weight",
            f"{_LAYER}.self_attention.linear_proj.weight": f"{_HF}.self_attn.o_proj.weight",
            f"{_LAYER}.mlp.router.weight": f"{_HF}.block_sparse_moe.gate.weight",
            f"{_LAYER}.mlp.experts.local_experts.*.linear_fc2.weight": f"{_HF}.block_sparse_moe.experts.*.w2.weight",
        }
        return MegatronMappingRegistry(
            *(AutoMapping(megatron_param=m, hf_param=h) for m, h in direct.items()),
            QKVMapping(
                megatron_param=f"{_LAYER}.self_attention.linear_qkv.weight",
                q=f"{_HF}.self_attn.q_proj.weight",
                k=f"{_HF}.self_attn.k_proj.weight",
                v=f"{_HF}.self_attn.v_proj.weight",
            ),
            GatedMLPMapping(
                megatron_param=f"{_LAYER}.mlp.experts.local_experts.*.linear_fc1.weight",
                gate=f"{_HF}.block_sparse_moe.experts.*.w1.weight",
                up=f"{_HF}.block_sparse_moe.experts.*.w3.weight",
            ),
        )
