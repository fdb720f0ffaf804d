"""``lora.*``: the resident adapter slots (how many, or sized from GPU memory), their rank and kernels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.sections.checks import check


@dataclass
class LoRAConfig:
    # resident adapter slots: a number, or auto: as many as fit, sized on each GPU rank from memory measured
    # after a warm-up step with auto_min_slots slots (trainer/auto_slots.py; refused on a CPU)
    num_slots: Any = 4
    auto_min_slots: int = 2  # auto: the probe's slots, and the fewest it accepts (fewer fitting is an error)
    auto_max_slots: int = 64  # auto: the most it sizes
    auto_memory_fraction: float = 0.9  # auto: the share of the GPU's memory the rank's peak may reach
    max_rank: int = 16
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    kernels: str = "auto"  # auto (Triton on CUDA when installed) | triton | torch
    # mixture-of-experts models: one fc1 A per slot shared by all experts (B stays per expert), and
    # the order of the (slot, expert) groups' rows in the expert LoRA kernels (slot_major | expert_major)
    shared_expert_a: bool = False
    expert_routing: str = "slot_major"
    # mixture-of-experts models: a fresh adapter of rank r gets rank r / moe_router_topk on each routed
    # expert (alpha kept, so its scale is alpha / (r / topk)); attention, dense MLPs and shared experts
    # keep r. As Megatron-Bridge's normalize_moe_lora and NeMo Automodel's moe_rank_scaling. r must be
    # a multiple of topk.
    expert_rank_scaling: bool = False

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``lora.*`` key of a value out of range."""
        check(
            self.num_slots == "auto" or (type(self.num_slots) is int and self.num_slots >= 1),
            "lora.num_slots",
            f"must be an integer >= 1 or auto (sized from GPU memory), got {self.num_slots!r}",
        )
        check(self.auto_min_slots >= 1, "lora.auto_min_slots", f"must be >= 1, got {self.auto_min_slots}")
        check(
            self.auto_max_slots >= self.auto_min_slots,
            "lora.auto_max_slots",
            f"must be >= lora.auto_min_slots ({self.auto_min_slots}), got {self.auto_max_slots}",
        )
        check(
            0 < self.auto_memory_fraction <= 1,
            "lora.auto_memory_fraction",
            f"must be in (0, 1], got {self.auto_memory_fraction}",
        )
        check(self.max_rank >= 1, "lora.max_rank", "must be >= 1")
        check(
            self.expert_routing in ("slot_major", "expert_major"),
            "lora.expert_routing",
            f"must be slot_major or expert_major, got {self.expert_routing!r}",
        )
        check(
            self.kernels in ("auto", "triton", "torch"),
            "lora.kernels",
            f"must be auto, triton or torch; got {self.kernels!r}",
        )
