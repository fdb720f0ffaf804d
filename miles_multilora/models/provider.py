"""Build Megatron ``GPTModel``s: from an HF checkpoint through megatron-bridge, or from a tiny config.

Both paths use Megatron's *local* layer spec (ColumnParallelLinear / RowParallelLinear), which
is what the MultiLoRA layers wrap, and honour TP/PP from ``parallel_state`` (call
``compat.init_distributed`` first). HF weights are converted by megatron-bridge's AutoBridge: no
hand-written per-architecture weight maps here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from miles_multilora.errors import ConfigError
from miles_multilora.models import compat, fused_qkv_rope
from miles_multilora.models.fused_mlp import FusedMLP, use_fused_mlp
from miles_multilora.models.sdpa_attention import set_fused_attention, with_sdpa_attention

# Architectures whose dense decoder maps onto the local GPT spec (what megatron-bridge converts
# and what our MultiLoRA layers target). Others are refused with a clear message.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
)
MOE_DISPATCHERS = ("allgather", "alltoall")


def moe_settings(dispatcher: str = "alltoall") -> dict[str, Any]:
    """TransformerConfig fields of a mixture-of-experts model under multi-LoRA (lora.moe): dropless
    routing with no auxiliary or z-loss and no jitter (each would couple the adapters of a batch), the
    experts as Megatron's SequentialMLP (its weights become grouped-GEMM stacks at injection), no
    Transformer Engine permutation, and ``dispatcher`` moving the tokens (allgather or alltoall)."""
    if dispatcher not in MOE_DISPATCHERS:
        raise ConfigError(
            "model.moe_token_dispatcher", f"must be one of {MOE_DISPATCHERS}, got {dispatcher!r}"
        )
    return {
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_input_jitter_eps": None,
        "moe_expert_capacity_factor": None,
        "moe_shared_expert_overlap": False,
    }


@dataclass
class LoadedModel:
    """A Megatron model with what callers need to use it."""

    model: GPTModel
    vocab_size: int  # the tokenizer's vocab size (logits may be padded beyond it)
    hf_config: Any  # the checkpoint's transformers config (PEFT export names, context length)
    bridge: Any  # megatron-bridge AutoBridge (its HF export checks a load in the tests)


def _dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ConfigError("model.dtype", f"unknown dtype {name!r}; use one of {sorted(table)}")
    return table[name]


RECOMPUTE = ("none", "selective", "full")


def recompute_settings(recompute: str) -> dict[str, Any]:
    """TransformerConfig fields of an activation-recompute choice: ``none``; ``selective`` (core
    attention recomputed in backward); ``full`` (every layer's input kept, the layer recomputed)."""
    if recompute not in RECOMPUTE:
        raise ConfigError("trainer.recompute", f"must be one of {RECOMPUTE}, got {recompute!r}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


def _embedding_output_requires_grad(
    module: torch.nn.Module, inputs: Any, output: torch.Tensor
) -> torch.Tensor:
    """Full recompute checkpoints each layer with a reentrant autograd Function, which only builds a
    graph when an *input* requires grad; with a frozen embedding (LoRA training) none does."""
    return output.requires_grad_(True) if module.training and not output.requires_grad else output


def gpt_module(model: torch.nn.Module) -> Any:
    """The ``GPTModel`` inside ``model``'s wrappers (DDP, Float16Module: each has ``.module``)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _finish(model: GPTModel, dtype: torch.dtype) -> GPTModel:
    model = model.to(device=compat.default_device(), dtype=dtype)
    use_fused_mlp(model)  # SwiGLU in one Triton kernel each way when the activations are on a GPU
    use_fused_qkv_rope(model, True)
    if getattr(model.config, "recompute_granularity", None) == "full" and model.pre_process:
        model.embedding.register_forward_hook(_embedding_output_requires_grad)
    return model


def build_tiny_gpt(
    num_layers: int = 2,
    hidden_size: int = 64,
    ffn_hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    vocab_size: int = 128,
    max_seq_len: int = 256,
    seed: int = 0,
    dtype: str = "float32",
    recompute: str = "none",
    num_experts: int = 0,
    moe_router_topk: int = 2,
    moe_ffn_hidden_size: int | None = None,
    moe_token_dispatcher: str = "allgather",
    moe_shared_expert_ffn_hidden_size: int | None = None,
    moe_shared_expert_gate: bool = False,
) -> GPTModel:
    """A small Llama-style GPTModel (RMSNorm, SwiGLU, RoPE, GQA, untied) with random init.
    ``recompute``: activation recompute in backward (:func:`recompute_settings`). ``num_experts`` > 0:
    every MLP is a mixture of that many SwiGLU experts of ``moe_ffn_hidden_size`` (default
    ``ffn_hidden_size``), ``moe_router_topk`` per token (softmax over the chosen experts' logits, as
    Mixtral and Qwen3-MoE with ``norm_topk_prob``), moved by ``moe_token_dispatcher``;
    ``moe_shared_expert_ffn_hidden_size``: beside them a shared SwiGLU expert of that hidden size on
    every token (Qwen2-MoE / DeepSeek style), scaled by a sigmoid gate with ``moe_shared_expert_gate``.

    Requires ``compat.init_distributed`` to have run (TP/PP/EP come from parallel_state).
    """
    compat.patch_cuda_current_device()
    torch.manual_seed(seed)
    moe: dict[str, Any] = {}
    if num_experts:
        moe = dict(
            num_moe_experts=num_experts,
            moe_router_topk=moe_router_topk,
            moe_ffn_hidden_size=moe_ffn_hidden_size or ffn_hidden_size,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=1,  # experts whole on each rank (compat.init_distributed)
            **moe_settings(moe_token_dispatcher),
        )
        if moe_shared_expert_ffn_hidden_size:
            moe["moe_shared_expert_intermediate_size"] = moe_shared_expert_ffn_hidden_size
            moe["moe_shared_expert_gate"] = moe_shared_expert_gate
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=compat.install_fused_rope(),
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=compat.is_cpu(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=_dtype(dtype),
        layernorm_epsilon=1e-6,
        **recompute_settings(recompute),
        **moe,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=num_experts or None, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=with_sdpa_attention(layer_spec),
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        parallel_output=False,  # full-vocab logits on every TP rank (sampling and logprobs need them)
        position_embedding_type="rope",
        rotary_base=10000,
    )
    return _finish(model, _dtype(dtype))


def set_fused_kernels(model: torch.nn.Module, enabled: bool) -> None:
    """Switch ``model`` between the fused training kernels (attention, SwiGLU, RoPE where
    available) and Megatron's own modules; for tests and benchmarks that compare the two."""
    set_fused_attention(model, enabled)
    for module in model.modules():
        if isinstance(module, FusedMLP):
            module.fused = enabled
    model.config.apply_rope_fusion = enabled and compat.install_fused_rope()
    use_fused_qkv_rope(model, enabled)


def use_fused_qkv_rope(model: torch.nn.Module, enabled: bool) -> bool:
    """The QKV split and RoPE in one kernel each way (``models/fused_qkv_rope``) where the model's
    attention allows it on every call and the hook is installed (a GPU with Triton); returns whether
    it is on."""
    gpt = gpt_module(model)
    on = enabled and fused_qkv_rope.eligible(gpt) and compat.install_fused_qkv_rope()
    if getattr(gpt, "config", None) is not None:
        gpt.config.fused_single_qkv_rope = on
    return on


def _bridge_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """megatron-bridge's local layer spec with the fused core attention (the MLPs are made fused
    after the build, :func:`~miles_multilora.models.fused_mlp.use_fused_mlp`)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    return with_sdpa_attention(local_layer_spec(config))


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, with clear errors for a missing dir or unsupported architecture."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError("model.hf_path", f"checkpoint directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("model.hf_path", f"{path} has no config.json: not an HF checkpoint directory")
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ConfigError(
            "model.hf_path",
            f"unsupported architecture {archs} in {config_file}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return config


def _moe_router(hf_config: dict[str, Any]) -> dict[str, Any]:
    """How the checkpoint's router weighs its top-k experts: a softmax over the chosen experts' logits
    (Mixtral; Qwen3-MoE with ``norm_topk_prob``) or the full softmax's top-k, not renormalised."""
    renormalised = hf_config.get("model_type") == "mixtral" or bool(hf_config.get("norm_topk_prob", False))
    return {"moe_router_pre_softmax": not renormalised}


def load_hf_model(
    path: str | Path,
    dtype: str = "float32",
    load_weights: bool = True,
    recompute: str = "none",
    moe_token_dispatcher: str = "alltoall",
) -> LoadedModel:
    """Build a GPTModel (local spec, TP/PP/EP from parallel_state) from an HF checkpoint dir via
    AutoBridge; ``recompute``: activation recompute in backward (:func:`recompute_settings`); a
    mixture-of-experts checkpoint gets :func:`moe_settings` (``moe_token_dispatcher``)."""
    hf_config = read_hf_config(path)
    if "MixtralForCausalLM" in hf_config.get("architectures", []):
        from miles_multilora.models import mixtral_bridge  # noqa: F401 - registers the bridge
    if "Qwen2MoeForCausalLM" in hf_config.get("architectures", []):
        from miles_multilora.models import qwen2_moe_bridge  # noqa: F401 - registers the bridge

    auto_bridge_cls = compat.import_auto_bridge()
    compat.patch_bridge_contiguous_scatter()
    compat.patch_bridge_sequential_experts()
    torch_dtype = _dtype(dtype)
    bridge = auto_bridge_cls.from_hf_pretrained(str(path), torch_dtype=torch_dtype)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = _bridge_layer_spec
    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.params_dtype = torch_dtype
    provider.bf16 = torch_dtype == torch.bfloat16
    provider.fp16 = torch_dtype == torch.float16
    provider.use_cpu_initialization = compat.is_cpu()
    provider.gradient_accumulation_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.masked_softmax_fusion = False
    provider.apply_rope_fusion = compat.install_fused_rope()
    provider.persist_layer_norm = False
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    provider.sequence_parallel = False  # needs TE/apex; see compat
    provider.parallel_output = False  # full-vocab logits on every TP rank (sampling and logprobs need them)
    for key, value in recompute_settings(recompute).items():
        setattr(provider, key, value)
    if getattr(provider, "num_moe_experts", None):
        moe = {**moe_settings(moe_token_dispatcher), **_moe_router(hf_config)}
        moe["expert_model_parallel_size"] = parallel_state.get_expert_model_parallel_world_size()
        moe["expert_tensor_parallel_size"] = 1
        for key, value in moe.items():
            setattr(provider, key, value)
    provider.finalize()
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide()
    model = _finish(model, torch_dtype)
    if load_weights:
        bridge.load_hf_weights([model])
    return LoadedModel(
        model=model,
        vocab_size=int(hf_config["vocab_size"]),
        hf_config=bridge.hf_pretrained.config,
        bridge=bridge,
    )
