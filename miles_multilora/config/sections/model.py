"""``model.*``: which checkpoint, its dtype and how it is split over the ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_multilora.config.sections.checks import check


def check_expert_split(num_experts: int, ep: int, source: str) -> None:
    """``model.ep`` must split the model's ``num_experts`` (read from ``source``) evenly over the ranks."""
    check(
        num_experts > 0,
        "model.ep",
        f"expert parallelism is for mixture-of-experts models; {source} has no experts: set model.ep=1",
    )
    check(
        num_experts % ep == 0,
        "model.ep",
        f"must divide the {num_experts} experts ({source}) so every rank holds as many; got model.ep={ep}",
    )


@dataclass
class TinyModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    vocab_size: int = 128
    max_seq_len: int = 256
    num_experts: int = 0  # > 0: every MLP is a mixture of this many experts (lora targets their fc1/fc2)
    moe_router_topk: int = 2  # experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's hidden size (None: ffn_hidden_size)
    # > 0: beside the routed experts a shared expert MLP of this hidden size on every token (None: none)
    moe_shared_expert_ffn_hidden_size: int | None = None
    moe_shared_expert_gate: bool = False  # the shared expert's output times a sigmoid gate (Qwen2-MoE)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``model.tiny.*`` key of a value out of range."""
        check(self.num_experts >= 0, "model.tiny.num_experts", "must be >= 0 (0: dense MLPs)")
        check(
            self.num_experts == 0 or 1 <= self.moe_router_topk <= self.num_experts,
            "model.tiny.moe_router_topk",
            f"must be in 1..model.tiny.num_experts ({self.num_experts}), got {self.moe_router_topk}",
        )
        shared = self.moe_shared_expert_ffn_hidden_size
        check(
            shared is None or (shared > 0 and self.num_experts > 0),
            "model.tiny.moe_shared_expert_ffn_hidden_size",
            f"must be None or > 0 with model.tiny.num_experts > 0 (a shared expert sits beside routed ones), "
            f"got {shared} with num_experts={self.num_experts}",
        )
        check(
            not self.moe_shared_expert_gate or bool(shared),
            "model.tiny.moe_shared_expert_gate",
            "gates a shared expert: set model.tiny.moe_shared_expert_ffn_hidden_size too",
        )


@dataclass
class ModelConfig:
    """``source``: ``demo`` (SmolLM2-135M-Instruct, converted by provision.sh), ``hf`` (hf_path) or ``tiny``."""

    source: str = "demo"
    hf_path: str | None = None
    cache_dir: str = "~/.cache/miles_multilora"
    dtype: str = "float32"
    # the frozen base's GEMMs in the layers with LoRA slots: dtype (model.dtype) | fp8 (e4m3 copies of the
    # base weights, scaled per channel, and activations scaled per token; trainer and embedded engine alike)
    base_precision: str = "dtype"
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # data-parallel replicas; None: trainer.world_size / (tp * pp), else 1
    # expert parallelism (MoE bases): each rank holds num_experts / ep experts; ep divides dp * tp.
    # The embedded engine's EP ranks decode their own rows and exchange tokens at every MoE layer
    ep: int = 1
    moe_token_dispatcher: str = "alltoall"  # mixture-of-experts models: allgather | alltoall
    # prompt + completion tokens; None: the checkpoint's max_position_embeddings (tiny: tiny.max_seq_len).
    # A lower value caps it (less KV cache and activation memory); a higher one is refused.
    max_context: int | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``model.*`` key of a value out of range."""
        check(
            self.source in ("demo", "hf", "tiny"),
            "model.source",
            f"must be demo, hf or tiny; got {self.source!r}",
        )
        check(
            self.source != "hf" or bool(self.hf_path),
            "model.hf_path",
            "set model.hf_path for model.source=hf",
        )
        check(self.tp >= 1 and self.pp >= 1, "model.tp", "tp and pp must be >= 1")
        check(
            self.base_precision in ("dtype", "fp8"),
            "model.base_precision",
            f"must be dtype (model.dtype) or fp8, got {self.base_precision!r}",
        )
        check(
            self.base_precision != "fp8" or self.tp == 1,
            "model.base_precision",
            f"fp8 needs model.tp=1 (tensor-parallel FP8 GEMMs are not built), got model.tp={self.tp}",
        )
        check(
            self.base_precision != "fp8" or self.tiny.num_experts == 0 or self.source != "tiny",
            "model.base_precision",
            "fp8 is for dense models (expert layers have no FP8 path); set model.tiny.num_experts=0 or base_precision=dtype",
        )
        check(
            self.max_context is None or self.max_context >= 2,
            "model.max_context",
            f"must be >= 2 tokens (or null: the checkpoint's), got {self.max_context}",
        )
        check(
            self.moe_token_dispatcher in ("allgather", "alltoall"),
            "model.moe_token_dispatcher",
            f"must be allgather or alltoall, got {self.moe_token_dispatcher!r}",
        )
        self.tiny.validate()
        check(self.dp is None or self.dp >= 1, "model.dp", "must be >= 1")
        check(self.ep >= 1, "model.ep", f"must be >= 1 (1: every rank holds every expert), got {self.ep}")
        if self.ep > 1 and self.source != "hf":  # an HF checkpoint's experts are checked when it is read
            tiny = self.source == "tiny"
            experts = self.tiny.num_experts if tiny else 0
            check_expert_split(
                experts, self.ep, "model.tiny.num_experts" if tiny else f"model.source={self.source}"
            )
        check(
            self.pp == 1,
            "model.pp",
            "pipeline parallelism is not supported by the trainer yet; use model.pp=1",
        )
