"""A megatron-bridge bridge for HF ``MixtralForCausalLM`` (megatron-bridge 0.3.1 has none).

Mixtral is a Llama-style decoder (RMSNorm, RoPE, GQA, no biases, untied) whose MLPs are a top-k
mixture of SwiGLU experts (``block_sparse_moe``: router ``gate``, experts' ``w1`` gate, ``w3``
up, ``w2`` down) with a softmax over the chosen experts' logits. The weights map onto
Megatron's local MoE layer with the bridge's own mapping types; importing this module registers
the bridge with ``AutoBridge``.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel

from miles_multilora.models import compat
from miles_multilora.models.llama_style import HF_LAYER, LAYER, dense_names, llama_style

compat.import_auto_bridge()  # imports megatron-bridge with the compat shims (TE/Triton placeholders)
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry  # noqa: E402
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge  # noqa: E402
from megatron.bridge.models.conversion.param_mapping import (  # noqa: E402
    AutoMapping,
    GatedMLPMapping,
    QKVMapping,
)
from transformers import MixtralForCausalLM  # noqa: E402


@MegatronModelBridge.register_bridge(source=MixtralForCausalLM, target=GPTModel, model_type="mixtral")
class MixtralBridge(MegatronModelBridge):
    """Megatron GPTModel <-> HF Mixtral."""

    def provider_bridge(self, hf_pretrained: Any) -> Any:
        provider = llama_style(super().provider_bridge(hf_pretrained), qkv_bias=False)
        config = hf_pretrained.config
        provider.num_moe_experts = config.num_local_experts
        provider.moe_router_topk = config.num_experts_per_tok
        provider.moe_ffn_hidden_size = config.intermediate_size
        provider.moe_router_pre_softmax = False  # softmax over the chosen experts' logits
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        direct = {
            **dense_names(),
            f"{LAYER}.mlp.router.weight": f"{HF_LAYER}.block_sparse_moe.gate.weight",
            f"{LAYER}.mlp.experts.local_experts.*.linear_fc2.weight": f"{HF_LAYER}.block_sparse_moe.experts.*.w2.weight",
        }
        return MegatronMappingRegistry(
            *(AutoMapping(megatron_param=m, hf_param=h) for m, h in direct.items()),
            QKVMapping(
                megatron_param=f"{LAYER}.self_attention.linear_qkv.weight",
                q=f"{HF_LAYER}.self_attn.q_proj.weight",
                k=f"{HF_LAYER}.self_attn.k_proj.weight",
                v=f"{HF_LAYER}.self_attn.v_proj.weight",
            ),
            GatedMLPMapping(
                megatron_param=f"{LAYER}.mlp.experts.local_experts.*.linear_fc1.weight",
                gate=f"{HF_LAYER}.block_sparse_moe.experts.*.w1.weight",
                up=f"{HF_LAYER}.block_sparse_moe.experts.*.w3.weight",
            ),
        )
