"""Will a training step fit on this GPU? The trainer rank's memory plan, made once at its start.

A rank holds, for the whole run, its share of the base weights, its LoRA slots with their
gradients and optimizer state, the embedded engine's KV cache and decode buffers, and Megatron's
RoPE tables; each micro-batch adds the activations its backward needs and one chunk of the LM
head. :class:`MemoryModel` estimates each of these from the model's shape and the run's settings
(pure arithmetic, documented per term below); :func:`decide` checks them against the memory the
GPU has free and picks what the user left open:

- ``trainer.recompute=auto``: no activation recompute when one sample of the whole context (the
  longest a step can hold) fits in one micro-batch, else full recompute (selective recompute keeps
  as much here, see below, and runs slower, so auto never picks it). An explicit choice is kept
  when it fits, else refused naming the one that would.
- ``trainer.max_tokens_per_micro_batch=0`` (no token budget): when ``micro_batch_size`` rows of the
  whole context would not fit, the largest budget that fits is set (rows are then packed by length,
  :mod:`~miles_multilora.trainer.microbatch`; the update is the same). An explicit budget that does
  not fit is refused with the largest that does.
- nothing fits: a :class:`~miles_multilora.errors.ConfigError` with the numbers (what each part
  needs against what is free) and what to change.

:func:`plan_rank` runs this on CUDA before the model is built (every rank with the least free
memory of any rank, so all make the same choice: TP ranks must recompute alike). On a CPU nothing
is known about limits: ``auto`` means no recompute and nothing else changes.

The activation terms count what autograd keeps per token and layer in this code base's layers
(bf16 or fp32, TP without sequence parallelism; ``h`` hidden, ``hq`` query heads x head dim,
``kv`` query groups x head dim, ``f`` FFN hidden, over TP where the layer splits them):

- attention: the input norm's input (h) and output (h, the QKV input the LoRA keeps), the QKV
  output (hq + 2kv: ``v`` is a view that keeps it alive), the rotated q and k (hq + kv), and the
  fused attention's output (hq), kept for its backward and as the projection's input (one tensor
  for a one-row micro-batch; several rows add a copy, within the slack). Selective recompute (core
  attention) keeps the same: the fused attention holds no ``S x S`` scores to drop, and its output
  stays as the projection's input (H100, 1.70 B shape, 32k tokens: 49.3 GiB with and without);
- MLP: the norm's input and output (2h), fc1's output (2f, kept by the fused SwiGLU) and fc2's
  input (f); a mixture of experts: the router's input (h) and, per routed copy (top-k), the
  permuted input (h) and the expert's 3 x its FFN size, plus a shared expert's 3 x its FFN size;
- full recompute keeps each layer's input (h) and re-runs one layer at a time in the backward;
- one layer's worth more is live while a layer's gradients are computed (with full recompute: the
  re-run layer), and ``4h`` per token outside the layers (final norm, selected hidden rows, the
  residual's gradient);
- the LM head runs on at most ``logprob_chunk_tokens`` rows at once (:mod:`~miles_multilora.algo.
  chunked_logprobs`): its logits and their gradient in the model dtype and an fp32 working copy.

On top, ``RESERVE_BYTES`` (CUDA/cuBLAS/Triton workspaces, NCCL buffers, the decode step's CUDA
graph pools) and ``FRAGMENTATION`` of each micro-batch's bytes (the caching allocator's slack).
``benchmarks/long_context.py`` prints each estimate beside the measured memory (H100, 1.70 B shape,
one 32k-token sample: 51.8 GiB estimated / 49.3 measured without recompute, 6.7 / 6.2 with full).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.run import RunConfig
from miles_multilora.config.sections.model import TinyModelConfig
from miles_multilora.errors import ConfigError
from miles_multilora.rollout.kv_cache import kv_bytes_per_token

log = logging.getLogger(__name__)

GIB = 1 << 30
RESERVE_BYTES = 2 * GIB  # workspaces, communication buffers, CUDA graph pools
FRAGMENTATION = 0.10  # of a micro-batch's bytes: allocator slack
RECOMPUTE_ORDER = ("none", "selective", "full")  # least recompute first
AUTO_ORDER = ("none", "full")  # what auto tries (selective keeps as much as none here)
BUDGET_STEP = 128  # a token budget the plan sets is a multiple of this
ROPE_CACHE_LENGTHS = 32  # Megatron's RotaryEmbedding caches the tables of this many lengths
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # lora.target_modules=all-linear
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model the estimate needs (whole model, before TP)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size / num_attention_heads
    tied_embeddings: bool = False
    num_experts: int = 0  # > 0: every MLP a mixture of experts
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # 0: ffn_hidden_size
    shared_expert_ffn: int = 0  # > 0: a shared expert (a dense MLP of this size) beside the routed ones

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @classmethod
    def from_tiny(cls, t: TinyModelConfig) -> ModelShape:
        return cls(
            t.num_layers, t.hidden_size, t.ffn_hidden_size, t.num_attention_heads, t.num_query_groups,
            t.vocab_size, num_experts=t.num_experts, moe_router_topk=t.moe_router_topk if t.num_experts else 0,
            moe_ffn_hidden_size=t.moe_ffn_hidden_size or 0,
            shared_expert_ffn=(t.moe_shared_expert_ffn_hidden_size or 0) if t.num_experts else 0,
        )  # fmt: skip

    @classmethod
    def from_hf_config(cls, c: Mapping[str, Any]) -> ModelShape:
        """From a checkpoint's ``config.json`` (Llama, Qwen2/3, Mistral, Qwen3-MoE, Mixtral keys)."""
        heads = int(c["num_attention_heads"])
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        return cls(
            num_layers=int(c["num_hidden_layers"]),
            hidden_size=int(c["hidden_size"]),
            ffn_hidden_size=int(c["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(c.get("num_key_value_heads") or heads),
            vocab_size=int(c["vocab_size"]),
            head_dim=int(c.get("head_dim") or 0),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            num_experts=experts,
            moe_router_topk=int(c.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn_hidden_size=int(c.get("moe_intermediate_size") or 0),
            shared_expert_ffn=int(c.get("shared_expert_intermediate_size") or 0) if experts else 0,
        )


@dataclass(frozen=True)
class MemoryModel:
    """Byte estimates of one rank (see the module docstring for each term)."""

    shape: ModelShape
    dtype_bytes: int = 2
    tp: int = 1
    ep: int = 1  # expert parallelism: each rank holds num_experts / ep of the routed experts
    lora_slots: int = 1
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGETS
    logprob_chunk_tokens: int = 1024
    kv_cache_bytes: int = 0  # the embedded engine's KV cache on this GPU (0: an HTTP engine)
    decode_rows: int = 0  # the embedded engine's decode batch rows (0: none)
    context: int = 0

    # ------------------------------------------------------------------ fixed
    def _sharded(self) -> tuple[int, int, int, int]:
        """(h, hq, kv, f) as one TP rank holds them in a layer's inner dimensions."""
        s, t = self.shape, self.tp
        return (
            s.hidden_size,
            s.num_attention_heads * s.dim // t,
            max(1, s.num_query_groups // t) * s.dim,
            s.ffn_hidden_size // t,
        )

    def base_weight_bytes(self) -> int:
        s, b = self.shape, self.dtype_bytes
        h, hq, kv, f = self._sharded()
        attention = h * (hq + 2 * kv) + hq * h
        if s.num_experts:  # the rank's experts (whole: expert TP 1), the router, the shared expert
            mlp = self.local_experts * 3 * h * s.expert_ffn + h * s.num_experts
            mlp += 3 * h * (s.shared_expert_ffn // self.tp)
        else:
            mlp = 3 * h * f
        vocab = s.vocab_size // self.tp * h * (1 if s.tied_embeddings else 2)
        return b * (s.num_layers * (attention + mlp + 2 * h) + vocab + h)

    @property
    def local_experts(self) -> int:
        """Routed experts this rank holds (``num_experts / ep``)."""
        return self.shape.num_experts // self.ep

    def lora_elements(self) -> int:
        """Elements of every slot's A and B on this rank (max rank, every target): the rank's own
        experts' and, with a shared expert, its (TP-sharded) ones."""
        s, r = self.shape, self.lora_rank
        h, hq, kv, f = self._sharded()
        experts = max(1, self.local_experts)
        fe = s.expert_ffn if s.num_experts else f
        fs = s.shared_expert_ffn // self.tp
        per_layer = {
            "linear_qkv": r * (h + hq + 2 * kv),
            "linear_proj": r * (hq + h),
            "linear_fc1": experts * r * (h + 2 * fe) + (r * (h + 2 * fs) if fs else 0),
            "linear_fc2": experts * r * (fe + h) + (r * (fs + h) if fs else 0),
        }
        total = s.num_layers * sum(per_layer[t] for t in self.lora_targets if t in per_layer)
        if "output_layer" in self.lora_targets:
            total += r * (h + s.vocab_size // self.tp)
        return self.lora_slots * total

    def lora_bytes(self) -> int:
        """LoRA weights and gradients (model dtype), AdamW moments (fp32) and fp32 masters of
        low-precision weights (:class:`~miles_multilora.optim.SlotAdamW`)."""
        b = self.dtype_bytes
        return self.lora_elements() * (2 * b + 8 + (4 if b < 4 else 0))

    def rope_bytes(self) -> int:
        """Megatron's cached RoPE tables (fp32, up to ``ROPE_CACHE_LENGTHS`` lengths of at most the
        context) and the engine's (fp32 angles, cos and sin in the model dtype)."""
        dim = self.shape.dim
        return (
            self.context
            * dim
            * (4 * ROPE_CACHE_LENGTHS + (4 + 2 * self.dtype_bytes if self.decode_rows else 0))
        )

    def decode_bytes(self) -> int:
        """The engine's per-row output buffers: tokens (int64) and logprobs (fp32) of a whole context."""
        return self.decode_rows * (self.context + 1) * 12

    def fixed(self) -> dict[str, int]:
        """What the rank holds for the whole run, by part (bytes)."""
        return {
            "base weights": self.base_weight_bytes(),
            "LoRA slots + optimizer": self.lora_bytes(),
            "KV cache": self.kv_cache_bytes,
            "decode buffers": self.decode_bytes(),
            "RoPE tables": self.rope_bytes(),
            "reserve": RESERVE_BYTES,
        }

    # ------------------------------------------------------------------ per micro-batch
    def layer_elements(self, recompute: str) -> int:
        """Elements kept per token by one layer for its backward."""
        s = self.shape
        h, hq, kv, f = self._sharded()
        if recompute == "full":
            return h
        attention = 2 * h + (hq + 2 * kv) + (hq + kv) + hq  # selective keeps the same (docstring)
        if s.num_experts:
            mlp = 2 * h + s.moe_router_topk * (h + 3 * s.expert_ffn) + 3 * (s.shared_expert_ffn // self.tp)
        else:
            mlp = 2 * h + 3 * f
        return attention + mlp + len(self.lora_targets) * self.lora_rank

    def activation_bytes(self, tokens: int, recompute: str) -> int:
        """Activations of a micro-batch of ``tokens`` padded tokens (see the module docstring)."""
        s = self.shape
        # + one layer's gradients (or, with full recompute, the re-run layer) and what is outside the layers
        per_token = (
            s.num_layers * self.layer_elements(recompute) + self.layer_elements("none") + 4 * s.hidden_size
        )
        return tokens * per_token * self.dtype_bytes

    def lm_head_bytes(self, tokens: int) -> int:
        rows = min(tokens, self.logprob_chunk_tokens)
        return rows * (self.shape.vocab_size // self.tp) * (2 * self.dtype_bytes + 4)

    def micro_batch_bytes(self, tokens: int, recompute: str) -> int:
        return self.activation_bytes(tokens, recompute) + self.lm_head_bytes(tokens)

    def need(self, tokens: int, recompute: str) -> int:
        """Bytes in all with a micro-batch of ``tokens`` padded tokens."""
        return sum(self.fixed().values()) + int(
            self.micro_batch_bytes(tokens, recompute) * (1 + FRAGMENTATION)
        )

    def max_tokens(self, available: int, recompute: str) -> int:
        """The most padded tokens per micro-batch that fit in ``available`` bytes (0: none)."""
        lo, hi = 0, 1
        while self.need(hi, recompute) <= available:
            lo, hi = hi, hi * 2
            if hi > 1 << 40:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.need(mid, recompute) <= available else (lo, mid)
        return lo


@dataclass
class MemoryPlan:
    """What :func:`decide` chose and the numbers behind it."""

    recompute: str
    max_tokens_per_micro_batch: int  # 0: no token budget (micro_batch_size rows of the context fit)
    available: int  # bytes free for this rank
    fixed: dict[str, int]
    tokens: int  # the largest micro-batch a step can form under the plan (padded tokens)
    need: int  # bytes in all with that micro-batch
    max_fit_tokens: int  # the largest micro-batch that fits with the chosen recompute
    changes: list[str] = field(default_factory=list)  # settings the plan chose, as "key=value (why)"

    def summary(self) -> str:
        fixed = ", ".join(f"{k} {gib(v)}" for k, v in self.fixed.items())
        return (
            f"memory plan: recompute={self.recompute}, micro-batches up to {self.tokens} tokens need "
            f"{gib(self.need)} GiB of {gib(self.available)} GiB free (fixed: {fixed}; up to "
            f"{self.max_fit_tokens} tokens would fit)"
            + (f"; set {'; '.join(self.changes)}" if self.changes else "")
        )


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _breakdown(model: MemoryModel, tokens: int, recompute: str, available: int) -> str:
    fixed = ", ".join(f"{k} {gib(v)}" for k, v in model.fixed().items() if v)
    return (
        f"{gib(model.need(tokens, recompute))} GiB with recompute={recompute} (fixed: {fixed}; the "
        f"micro-batch: activations {gib(model.activation_bytes(tokens, recompute))}, LM head chunk "
        f"{gib(model.lm_head_bytes(tokens))}, + {FRAGMENTATION:.0%} slack) but {gib(available)} GiB are free"
    )


def decide(
    model: MemoryModel,
    available: int,
    *,
    context: int,
    recompute: str,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int,
) -> MemoryPlan:
    """The plan for a rank with ``available`` free bytes (see the module docstring); raises
    :class:`ConfigError` when no allowed choice fits. Pure: no device is touched."""
    candidates = AUTO_ORDER if recompute == "auto" else (recompute,)
    budget = max_tokens_per_micro_batch
    worst = (
        micro_batch_size * context if budget <= 0 else min(max(budget, context), micro_batch_size * context)
    )
    for choice in candidates:
        if model.need(context, choice) > available:
            continue
        fit = model.max_tokens(available, choice)
        changes = [f"trainer.recompute={choice} (auto)"] if recompute == "auto" else []
        if model.need(worst, choice) <= available:
            tokens, new_budget = worst, budget
        elif budget <= 0:
            new_budget = max(context, fit // BUDGET_STEP * BUDGET_STEP)
            tokens = new_budget
            changes.append(
                f"trainer.max_tokens_per_micro_batch={new_budget} ({micro_batch_size} rows of {context} "
                "tokens would not fit)"
            )
        else:
            continue  # an explicit budget too large for this choice: a heavier recompute may fit it
        return MemoryPlan(
            choice, new_budget, available, model.fixed(), tokens, model.need(tokens, choice), fit, changes
        )
    # nothing allowed fits: say why, with the numbers, and what would
    fits_context = [c for c in AUTO_ORDER if model.need(context, c) <= available]
    if recompute != "auto" and model.need(context, recompute) > available:
        if fits_context:
            raise ConfigError(
                "trainer.recompute",
                f"a {context}-token sample (the context) needs {_breakdown(model, context, recompute, available)}; "
                f"recompute={fits_context[0]} fits it: set trainer.recompute={fits_context[0]} or auto",
            )
    elif fits_context:  # the context fits, the explicit token budget does not
        best = fits_context[-1] if recompute == "auto" else recompute
        fit = model.max_tokens(available, best)
        raise ConfigError(
            "trainer.max_tokens_per_micro_batch",
            f"micro-batches of up to {worst} tokens need {_breakdown(model, worst, best, available)}; at most "
            f"{fit} tokens fit with recompute={best}: lower trainer.max_tokens_per_micro_batch to {fit // BUDGET_STEP * BUDGET_STEP}"
            + (" or set trainer.recompute=auto" if recompute not in ("auto", "full") else ""),
        )
    most = model.max_tokens(available, "full")
    raise ConfigError(
        "model.max_context",
        f"a {context}-token sample (the context) does not fit in one micro-batch: it needs "
        f"{_breakdown(model, context, 'full', available)}. At most {most} tokens fit with full recompute: "
        f"lower model.max_context (to {most} or less), the KV cache (rollout.kv_cache_fraction or "
        "rollout.kv_cache_tokens), lora.num_slots or lora.max_rank, or split the model over more GPUs (model.tp)",
    )


def memory_model(cfg: RunConfig, shape: ModelShape, context: int, device_total: int) -> MemoryModel:
    """The estimate for ``cfg``'s rank: its dtype, TP, LoRA slots, LM-head chunk, and the embedded
    engine's KV cache as the engine sizes it (``rollout.kv_cache_tokens``, else
    ``rollout.kv_cache_fraction`` of ``device_total``, at most ``max_batch_size`` rows of the context;
    ``rollout.kv_cache_dtype=fp8``: a byte per value and each head's scale)."""
    if cfg.model.dtype not in DTYPE_BYTES:
        raise ConfigError(
            "model.dtype", f"unknown dtype {cfg.model.dtype!r}; use one of {sorted(DTYPE_BYTES)}"
        )
    b = DTYPE_BYTES[cfg.model.dtype]
    r, tp = cfg.rollout, cfg.model.tp
    embedded = r.engine == "embedded"
    groups = max(1, shape.num_query_groups // tp)
    kv_per_token = kv_bytes_per_token(shape.num_layers, groups, shape.dim, b, r.kv_cache_dtype == "fp8")
    kv = 0
    if embedded:
        tokens = r.kv_cache_tokens or min(
            int(r.kv_cache_fraction * device_total) // kv_per_token, r.max_batch_size * context
        )
        kv = (-(-tokens // r.page_size) + 1) * r.page_size * kv_per_token  # + the null page
    targets = list(cfg.lora.target_modules)
    return MemoryModel(
        shape,
        dtype_bytes=b,
        tp=tp,
        ep=cfg.model.ep,
        lora_slots=cfg.lora.num_slots,
        lora_rank=cfg.lora.max_rank,
        lora_targets=LORA_TARGETS if targets == ["all-linear"] else tuple(targets),
        logprob_chunk_tokens=cfg.trainer.logprob_chunk_tokens,
        kv_cache_bytes=kv,
        decode_rows=r.max_batch_size if embedded else 0,
        context=context,
    )


def free_bytes() -> tuple[int, int]:
    """(bytes this process can still allocate on its GPU, the GPU's total), the least over every
    rank when torch.distributed runs (all ranks then plan alike)."""
    import torch
    import torch.distributed as dist

    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([free, total], dtype=torch.int64, device=f"cuda:{device}")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        free, total = int(t[0]), int(t[1])
    return int(free), int(total)


def plan_rank(cfg: RunConfig, shape: ModelShape, context: int) -> MemoryPlan | None:
    """Plan ``cfg``'s rank before its model is built and write the choices into ``cfg.trainer``
    (``recompute`` resolved, ``max_tokens_per_micro_batch`` when the plan sets one). On a CPU, or
    with ``trainer.memory_check=false``: ``auto`` becomes ``none`` and nothing is checked (None)."""
    import torch

    t = cfg.trainer
    if not torch.cuda.is_available() or not t.memory_check:
        if t.recompute == "auto":
            t.recompute = "none"
        return None
    free, total = free_bytes()
    plan = decide(
        memory_model(cfg, shape, context, total),
        free,
        context=context,
        recompute=t.recompute,
        micro_batch_size=t.micro_batch_size,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
    )
    t.recompute = plan.recompute
    t.max_tokens_per_micro_batch = plan.max_tokens_per_micro_batch
    log.info("%s", plan.summary())
    return plan
