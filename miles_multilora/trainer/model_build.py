"""What a trainer rank is built from: the Megatron model with its MultiLoRA slots, its tokenizer,
and its rollout engine (the embedded engine on the rank's own model, expert-parallel at
``model.ep > 1``, or an HTTP engine).

The rank's context is the checkpoint's own (``max_position_embeddings``; the tiny model's
``model.tiny.max_seq_len``), or ``model.max_context`` below it. Before the model is built, the
memory plan (:mod:`~miles_multilora.trainer.memory_plan`) checks on a GPU that a step fits and
resolves ``trainer.recompute=auto``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_multilora.config.run import RunConfig
from miles_multilora.config.sections.model import check_expert_split
from miles_multilora.lora import apply_multi_lora
from miles_multilora.lora.inject import use_fp8_base
from miles_multilora.models import provider
from miles_multilora.models.paths import capped_context, resolve_model_path
from miles_multilora.rollout import RolloutEngine
from miles_multilora.trainer.memory_plan import MemoryPlan, ModelShape, plan_rank
from miles_multilora.trainer.tokenizer import load_tokenizer, stop_token_ids


@dataclass
class BuiltModel:
    """The model with its slots, and what callers need to feed it."""

    model: torch.nn.Module
    vocab_size: int  # the tokenizer's vocabulary (logits may be padded beyond it)
    max_seq_len: int  # prompt + completion tokens the rank handles
    hf_config: Any  # the checkpoint's transformers config (None for the tiny model): PEFT export names
    tokenizer: Any
    pad_id: int
    memory: MemoryPlan | None = None  # the start-up memory plan (None on a CPU or without the check)


def build_model(cfg: RunConfig) -> BuiltModel:
    """``cfg.model`` (tiny random, or an HF checkpoint through megatron-bridge) with ``cfg.lora``'s
    slots in its target layers. ``compat.init_distributed`` must have run. The memory plan's choices
    are written into ``cfg.trainer`` first (``recompute`` resolved; a token budget when it sets one)."""
    model_path = resolve_model_path(cfg)
    if model_path is None:
        t = cfg.model.tiny
        max_seq_len = capped_context(cfg, t.max_seq_len, "model.tiny.max_seq_len")
        memory = plan_rank(cfg, ModelShape.from_tiny(t), max_seq_len)
        model = provider.build_tiny_gpt(
            t.num_layers, t.hidden_size, t.ffn_hidden_size, t.num_attention_heads, t.num_query_groups,
            t.vocab_size, t.max_seq_len, seed=cfg.trainer.seed, dtype=cfg.model.dtype,
            recompute=cfg.trainer.recompute, num_experts=t.num_experts, moe_router_topk=t.moe_router_topk,
            moe_ffn_hidden_size=t.moe_ffn_hidden_size, moe_token_dispatcher=cfg.model.moe_token_dispatcher,
            moe_shared_expert_ffn_hidden_size=t.moe_shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=t.moe_shared_expert_gate,
        )  # fmt: skip
        vocab_size, hf_config = t.vocab_size, None
    else:
        config = provider.read_hf_config(model_path)
        if cfg.model.ep > 1:
            experts = config.get("num_experts") or config.get("num_local_experts") or 0
            check_expert_split(int(experts), cfg.model.ep, str(model_path / "config.json"))
        native = config.get("max_position_embeddings")
        source = str(model_path / "config.json")
        max_seq_len = capped_context(cfg, None if native is None else int(native), source)
        memory = plan_rank(cfg, ModelShape.from_hf_config(config), max_seq_len)
        loaded = provider.load_hf_model(
            model_path,
            dtype=cfg.model.dtype,
            recompute=cfg.trainer.recompute,
            moe_token_dispatcher=cfg.model.moe_token_dispatcher,
        )
        model, vocab_size, hf_config = loaded.model, loaded.vocab_size, loaded.hf_config
    tokenizer = load_tokenizer(model_path, vocab_size)
    targets = list(cfg.lora.target_modules)
    apply_multi_lora(
        model,
        targets[0] if targets == ["all-linear"] else targets,
        num_slots=cfg.lora.num_slots,
        max_rank=cfg.lora.max_rank,
        kernels=cfg.lora.kernels,
        shared_expert_a=cfg.lora.shared_expert_a,
        expert_routing=cfg.lora.expert_routing,
        expert_rank_scaling=cfg.lora.expert_rank_scaling,
    )
    if cfg.model.base_precision == "fp8":
        use_fp8_base(model)
    pad = getattr(tokenizer, "pad_token_id", None)
    return BuiltModel(
        model, vocab_size, max_seq_len, hf_config, tokenizer, int(pad if pad is not None else 0), memory
    )


def build_engine(cfg: RunConfig, built: BuiltModel, *, manages_adapters: bool, dp_rank: int) -> RolloutEngine:
    """``cfg.rollout``'s engine: the embedded engine serves ``built.model`` itself; an HTTP engine
    (SGLang, vLLM) gets each adapter version as an exported PEFT dir. ``manages_adapters``: this
    rank loads adapters on the servers (one rank does); DP ranks start at different servers."""
    r = cfg.rollout
    eos = stop_token_ids(built.tokenizer, resolve_model_path(cfg))
    if r.engine != "embedded":
        from miles_multilora.rollout.factory import remote_engine

        return remote_engine(
            r,
            manages_adapters=manages_adapters,
            first_server=dp_rank,
            eos_token_ids=eos,
            export_root=str(Path(cfg.trainer.output_dir) / "sync"),  # where the rank exports versions
        )
    from miles_multilora.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(
        built.model,
        vocab_size=built.vocab_size,
        max_seq_len=built.max_seq_len,
        tokenizer=built.tokenizer,
        eos_token_ids=eos,
        max_batch_size=r.max_batch_size,
        pad_id=built.pad_id,
        page_size=r.page_size,
        kv_cache_tokens=r.kv_cache_tokens,
        kv_cache_fraction=r.kv_cache_fraction,
        kv_cache_dtype=r.kv_cache_dtype,
        shared_prefix_attention=r.shared_prefix_attention,
        cuda_graphs=r.cuda_graphs,
        sync_interval=r.sync_interval,
    )
