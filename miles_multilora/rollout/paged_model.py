"""A forward pass over a Megatron ``GPTModel``'s own modules that keeps K/V in a paged cache.

The model's modules do the work (embedding, norms, the QKV/proj/MLP linears with their MultiLoRA
slots and TP collectives, RoPE, output layer); only attention and the KV cache are the engine's:
prompts are prefilled with causal SDPA and their K/V written to pages, and a decode step runs one
token per row against :func:`~miles_multilora.rollout.paged_attention.paged_decode_attention`.
Every row has its own position (no left padding), exactly like the trainer's right-padded
forward, and a decode step has no host sync, so it can be captured in a CUDA graph.

With ``kv_cache_dtype="fp8"`` the pages hold e4m3 K/V and per-(token, head) scales
(:mod:`~miles_multilora.rollout.kv_quant`); prefill attends over its K/V as the pages give them back,
so every attention (prefill, decode, a resumed row's prefill) reads the same values.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from torch import Tensor

from miles_multilora.config.sections.rollout import KV_CACHE_DTYPES
from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.lora.row_delta import RowDelta, RowShrink
from miles_multilora.models.compat import lm_head_logits
from miles_multilora.models.provider import gpt_module
from miles_multilora.models.sdpa_attention import causal_attention
from miles_multilora.rollout.decode_fusions import add_rmsnorm, fusable, swiglu
from miles_multilora.rollout.engine import RolloutError
from miles_multilora.rollout.expert_parallel import ExpertParallel, moe_decode_ep
from miles_multilora.rollout.kv_cache import PagedKVCache, kv_bytes_per_token
from miles_multilora.rollout.kv_quant import as_stored
from miles_multilora.rollout.moe_decode import is_moe, moe_decode, prepare_moe
from miles_multilora.rollout.paged_attention import paged_decode_attention, write_decode_kv, write_prefill_kv
from miles_multilora.rollout.rope_kv import fused_rope_kv_supported, rope_and_write_kv
from miles_multilora.rollout.shared_prefix import PrefixGroups, shared_prefix_attention
from miles_multilora.scoring.logprobs import lm_head_weight


class PagedModel:
    """Prefill and decode of ``model`` (a GPTModel, TP-sharded or not) against a :class:`PagedKVCache`."""

    def __init__(self, model: torch.nn.Module, max_seq_len: int, kv_cache_dtype: str = "bf16") -> None:
        self.model = gpt = gpt_module(model)
        cfg = gpt.config
        problems = [
            (getattr(gpt, "position_embedding_type", None) != "rope", "only RoPE position embeddings"),
            (bool(getattr(cfg, "fp32_residual_connection", False)), "fp32_residual_connection"),
            (
                bool(getattr(cfg, "apply_residual_connection_post_layernorm", False)),
                "post-layernorm residuals",
            ),
            (getattr(cfg, "window_size", None) is not None, "sliding-window attention"),
            (bool(getattr(cfg, "attention_output_gate", False)), "gated attention output"),
            (not (gpt.pre_process and gpt.post_process), "pipeline parallelism"),
            (parallel_state.get_context_parallel_world_size() > 1, "context parallelism"),
        ]
        unsupported = [what for bad, what in problems if bad]
        if unsupported:
            raise RolloutError(f"the embedded engine does not support {', '.join(unsupported)}; use sglang")
        self.fp8 = False
        self.set_kv_cache_dtype(kv_cache_dtype)
        self.config = cfg
        self.layers = list(gpt.decoder.layers)
        attn = self.layers[0].self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.kv_heads = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.scales = [float(layer.self_attention.core_attention.softmax_scale) for layer in self.layers]
        self.max_seq_len = max_seq_len
        with torch.no_grad():
            self.freqs = gpt.rotary_pos_emb(max_seq_len)  # [max_seq_len, 1, 1, rot_dim]
            # cos/sin per position in the model dtype, exactly as Megatron's RoPE computes them
            mscale = _yarn_get_concentration_factor_from_config(cfg)
            flat = self.freqs.reshape(max_seq_len, -1)
            self.cos = (torch.cos(flat) * mscale).to(self.dtype)
            self.sin = (torch.sin(flat) * mscale).to(self.dtype)
        interleaved = bool(getattr(cfg, "rotary_interleaved", False))
        # the fused kernel reads the QKV linear's output in Megatron's grouped layout, which a rank
        # holds whole unless TP splits the kv groups (then Megatron regathers it)
        whole_groups = cfg.num_query_groups is None or cfg.num_query_groups >= attn.world_size
        self.fused_rope = whole_groups and fused_rope_kv_supported(
            self.device, self.head_dim, self.freqs.shape[-1], interleaved
        )
        self.fused: dict[int, bool] = {}  # id(module) -> its fused decode kernel applies
        for layer in self.layers:
            for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                self.fused[id(norm)] = fusable(norm, layer.mlp, self.device)[0]
            moe = is_moe(layer.mlp)  # its own static decode (rollout.moe_decode), no fused SwiGLU
            if moe:
                prepare_moe(layer.mlp)
            self.fused[id(layer.mlp)] = not moe and fusable(layer.input_layernorm, layer.mlp, self.device)[1]
        final = gpt.decoder.final_layernorm
        self.fused[id(final)] = fusable(final, self.layers[0].mlp, self.device)[0]
        self.cp_group = parallel_state.get_context_parallel_group()
        # model.ep > 1: the decode step's MoE layers exchange rows with the other EP ranks
        self.expert_parallel = ExpertParallel.of_model(gpt, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """The page dtype of the caches :meth:`new_cache` makes: ``bf16`` (the model's) or ``fp8``."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        fp8 = kv_cache_dtype == "fp8"
        if fp8 and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise RolloutError(
                "rollout.kv_cache_dtype=fp8: the paged attention kernels read e4m3 pages on compute "
                f"capability 8.9+ (Ada, Hopper) only; this GPU is {torch.cuda.get_device_name(self.device)}. "
                "Use rollout.kv_cache_dtype=bf16"
            )
        self.fp8 = fp8

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token takes in the cache, over all layers (this TP rank), scales included."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return kv_bytes_per_token(len(self.layers), self.kv_heads, self.head_dim, itemsize, self.fp8)

    def new_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        return PagedKVCache(
            len(self.layers),
            num_pages,
            page_size,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
            fp8=self.fp8,
        )

    # ------------------------------------------------------------------ pieces
    def _rope(self, t: Tensor, freqs: Tensor) -> Tensor:
        return apply_rotary_pos_emb(t, freqs, config=self.config, cp_group=self.cp_group)

    def _logits(self, hidden: Tensor, normed: bool = False) -> Tensor:
        """``hidden`` ``[1, B, H]`` after the last layer (``normed``: after the final norm too) ->
        full-vocab logits ``[B, V]``."""
        gpt = self.model
        if not normed:
            hidden = gpt.decoder.final_layernorm(hidden)
        weight = lm_head_weight(gpt)
        if weight is None:  # a LoRA-adapted or biased head: its own forward (logits in the model's dtype)
            weight = (
                gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
            )
            logits, _ = gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)
            return logits[0]
        logits = lm_head_logits(
            hidden[0], weight
        )  # fp32, as the trainer scores (scoring/chunked_logprobs.py)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits

    def _norm(
        self, hidden: Tensor, norm: torch.nn.Module, delta: Tensor | None, lora: RowDelta | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(hidden + delta, norm(hidden + delta))``, ``delta``'s deferred LoRA term added to it
        first: one fused kernel when the norm allows it."""
        if self.fused[id(norm)]:
            return add_rmsnorm(hidden, delta, norm, lora)
        if delta is not None:
            hidden = hidden + (lora.add_to(delta) if lora is not None else delta)
        return hidden, norm(hidden)

    @staticmethod
    def _linear(
        module: torch.nn.Module, x: Tensor, consumer_expands: bool = False
    ) -> tuple[Tensor, RowDelta | RowShrink | None]:
        """A decode step's linear: its output (bias added) and the LoRA term it left to the consumer
        (:meth:`MultiLoRALinear.forward_deferred`; None when it added it itself)."""
        if isinstance(module, MultiLoRALinear):
            out, bias, lora = module.forward_deferred(x, consumer_expands=consumer_expands)
        else:
            (out, bias), lora = module(x), None
        if bias is not None:  # the LoRA term goes on the output before the bias, as in the layer
            out, lora = (lora.add_to(out) if lora is not None else out) + bias, None
        return out, lora

    def _mlp(self, layer: Any, x: Tensor) -> tuple[Tensor, RowDelta | RowShrink | None]:
        """The layer's MLP output (bias added) and fc2's deferred LoRA term; the SwiGLU is fused
        (and runs fc1's LoRA expand) when the config allows it. A mixture of experts runs its static
        decode step (:func:`~miles_multilora.rollout.moe_decode.moe_decode`; with expert parallelism
        :func:`~miles_multilora.rollout.expert_parallel.moe_decode_ep`)."""
        mlp = layer.mlp
        if is_moe(mlp):
            if self.expert_parallel is not None:
                return moe_decode_ep(mlp, x, self.expert_parallel), None
            return moe_decode(mlp, x), None
        if self.fused[id(mlp)]:
            out, lora = self._linear(mlp.linear_fc1, x, consumer_expands=True)
            return self._linear(mlp.linear_fc2, swiglu(out, lora))
        out, bias = mlp(x)
        return (out + bias if bias is not None else out), None

    def _qkv(
        self, i: int, attn: Any, x: Tensor, cache: PagedKVCache, positions: Tensor, table: Tensor
    ) -> Tensor:
        """Layer ``i``'s queries ``[B, H, D]`` (RoPE applied); its k and v stored in the cache."""
        batch = x.shape[1]
        k_cache, v_cache, k_scale, v_scale = cache.layer(i)
        if self.fused_rope:  # one kernel on the fused QKV output: RoPE on q and k, and the KV write
            mixed, lora = self._linear(attn.linear_qkv, x)
            mixed = mixed.view(batch, self.kv_heads, -1, self.head_dim)
            return rope_and_write_kv(
                mixed, self.cos, self.sin, positions, table, k_cache, v_cache, lora, k_scale, v_scale
            )
        q, k, v = attn.get_query_key_value_tensors(x, None)
        freqs = self.freqs[positions.long()].transpose(0, 1)  # [1, B, 1, rot_dim]
        q, k = self._rope(q, freqs)[0], self._rope(k, freqs)
        write_decode_kv(k_cache, v_cache, k[0], v[0], table, positions, k_scale, v_scale)
        return q

    @staticmethod
    def _add(residual: Tensor, out_with_bias: tuple[Tensor, Tensor | None]) -> Tensor:
        """Megatron's bias-dropout-add at inference: ``residual + (out + bias)``."""
        out, bias = out_with_bias
        return residual + (out + bias if bias is not None else out)

    # ------------------------------------------------------------------ prefill
    def prefill(self, cache: PagedKVCache, tokens: Tensor, lengths: Tensor, block_table: Tensor) -> Tensor:
        """Run right-padded prompts ``tokens`` ``[B, S]`` (valid positions ``< lengths[b]``), store
        their K/V in the pages of ``block_table`` ``[B, pages]``; return each prompt's last logits
        ``[B, V]``. Slot routing must be set by the caller (``token_slots``)."""
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, -1)
        hidden = self.model.embedding(input_ids=tokens, position_ids=positions)  # [S, B, H]
        freqs = self.freqs[:seq]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attention
            q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(hidden), None)
            q, k = self._rope(q, freqs), self._rope(k, freqs)
            k_cache, v_cache, k_scale, v_scale = cache.layer(i)
            rows_k, rows_v = k.transpose(0, 1), v.transpose(0, 1)
            write_prefill_kv(k_cache, v_cache, rows_k, rows_v, block_table, lengths, k_scale, v_scale)
            if cache.fp8:  # attend over what the pages hold, as every later step does
                k, v = as_stored(k), as_stored(v)
            ctx = causal_attention(
                q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), self.scales[i]
            )
            ctx = ctx.permute(2, 0, 1, 3).reshape(seq, batch, self.heads * self.head_dim)
            hidden = self._add(hidden, attn.linear_proj(ctx))
            hidden = self._add(hidden, layer.mlp(layer.pre_mlp_layernorm(hidden)))
        last = hidden[(lengths.to(hidden.device) - 1).long(), torch.arange(batch, device=hidden.device)]
        return self._logits(last.unsqueeze(0))

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        cache: PagedKVCache,
        tokens: Tensor,
        positions: Tensor,
        block_table: Tensor,
        groups: PrefixGroups | None = None,
    ) -> Tensor:
        """One token per row: ``tokens`` ``[B]`` at ``positions`` ``[B]`` (its index in its row). Writes
        its K/V there, attends over the row's first ``positions + 1`` keys; returns logits ``[B, V]``.
        ``groups``: the rows' shared prompt pages, each read once per group (shared-prefix attention).
        No host sync: capturable. Slot routing must be set by the caller."""
        batch = tokens.shape[0]
        hidden = self.model.embedding(input_ids=tokens.view(batch, 1), position_ids=positions.view(batch, 1))
        lens = (positions + 1).to(torch.int32)
        # the previous block's output and its deferred LoRA term, added before the next norm
        pending: tuple[Tensor | None, RowDelta | None] = (None, None)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attention
            hidden, x = self._norm(hidden, layer.input_layernorm, *pending)
            q = self._qkv(i, attn, x, cache, positions, block_table)
            k_cache, v_cache, k_scale, v_scale = cache.layer(i)
            scale = self.scales[i]
            if groups is not None:
                ctx = shared_prefix_attention(
                    q, k_cache, v_cache, block_table, lens, scale, groups, k_scale=k_scale, v_scale=v_scale
                )
            else:
                ctx = paged_decode_attention(
                    q, k_cache, v_cache, block_table, lens, scale, k_scale=k_scale, v_scale=v_scale
                )
            out, lora = self._linear(attn.linear_proj, ctx.reshape(1, batch, self.heads * self.head_dim))
            hidden, x = self._norm(hidden, layer.pre_mlp_layernorm, out, lora)
            pending = self._mlp(layer, x)
        _, x = self._norm(hidden, self.model.decoder.final_layernorm, *pending)
        return self._logits(x, normed=True)
