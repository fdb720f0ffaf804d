"""A megatron-bridge bridge for HF ``Qwen2MoeForCausalLM`` (megatron-bridge 0.3.1 has none).

Qwen2-MoE is a Qwen2 decoder (RMSNorm, RoPE, GQA, biases on q/k/v only, untied) whose MLPs are a
top-k mixture of SwiGLU experts (router ``mlp.gate``, softmax over all experts, top-k renormalised
only with ``norm_topk_prob``) beside a shared SwiGLU expert (``mlp.shared_expert``) on every token,
scaled by a sigmoid gate (``mlp.shared_expert_gate``). The weights map onto Megatron's local MoE
layer and its ``SharedExpertMLP`` (gated) with the bridge's own mapping types; importing this
module registers the bridge with ``AutoBridge``. Every layer must be sparse (no ``mlp_only_layers``,
``decoder_sparse_step`` 1).
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel

from miles_multilora.errors import ConfigError
from miles_multilora.models import compat
from miles_multilora.models.llama_style import HF_LAYER, LAYER, dense_names, llama_style

compat.import_auto_bridge()  # imports megatron-bridge with the compat shims (TE/Triton placeholders)
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry  # noqa: E402
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge  # noqa: E402
from megatron.bridge.models.conversion.param_mapping import (  # noqa: E402
    AutoMapping,
    GatedMLPMapping,
    QKVMapping,
    ReplicatedMapping,
)
from transformers import Qwen2MoeForCausalLM  # noqa: E402


@MegatronModelBridge.register_bridge(source=Qwen2MoeForCausalLM, target=GPTModel, model_type="qwen2_moe")
class Qwen2MoeBridge(MegatronModelBridge):
    """Megatron GPTModel <-> HF Qwen2-MoE."""

    def provider_bridge(self, hf_pretrained: Any) -> Any:
        config = hf_pretrained.config
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise ConfigError(
                "model.hf_path",
                "Qwen2-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported: "
                "every layer must be a mixture of experts",
            )
        provider = llama_style(super().provider_bridge(hf_pretrained), qkv_bias=True)
        provider.num_moe_experts = config.num_experts
        provider.moe_router_topk = config.num_experts_per_tok
        provider.moe_ffn_hidden_size = config.moe_intermediate_size
        provider.moe_shared_expert_intermediate_size = config.shared_expert_intermediate_size
        provider.moe_shared_expert_gate = True
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        shared = f"{LAYER}.mlp.shared_experts"
        direct = {
            **dense_names(),
            f"{LAYER}.mlp.router.weight": f"{HF_LAYER}.mlp.gate.weight",
            f"{LAYER}.mlp.experts.local_experts.*.linear_fc2.weight": f"{HF_LAYER}.mlp.experts.*.down_proj.weight",
            f"{shared}.linear_fc2.weight": f"{HF_LAYER}.mlp.shared_expert.down_proj.weight",
        }
        qkv = {
            which: {p: f"{HF_LAYER}.self_attn.{p}_proj.{which}" for p in ("q", "k", "v")}
            for which in ("weight", "bias")
        }
        return MegatronMappingRegistry(
            *(AutoMapping(megatron_param=m, hf_param=h) for m, h in direct.items()),
            ReplicatedMapping(
                megatron_param=f"{shared}.gate_weight", hf_param=f"{HF_LAYER}.mlp.shared_expert_gate.weight"
            ),
            *(
                QKVMapping(megatron_param=f"{LAYER}.self_attention.linear_qkv.{which}", **names)
                for which, names in qkv.items()
            ),
            GatedMLPMapping(
                megatron_param=f"{LAYER}.mlp.experts.local_experts.*.linear_fc1.weight",
                gate=f"{HF_LAYER}.mlp.experts.*.gate_proj.weight",
                up=f"{HF_LAYER}.mlp.experts.*.up_proj.weight",
            ),
            GatedMLPMapping(
                megatron_param=f"{shared}.linear_fc1.weight",
                gate=f"{HF_LAYER}.mlp.shared_expert.gate_proj.weight",
                up=f"{HF_LAYER}.mlp.shared_expert.up_proj.weight",
            ),
        )
