"""MultiLoRAExpertLinear: N LoRA slots on one projection (fc1 or fc2) of every local expert of an MoE layer.

``lora_A`` is ``[N, E, R, in]`` (``[N, 1, R, in]`` with an A shared by the experts) and ``lora_B``
``[N, E, out, R]``: slot ``s`` of local expert ``e`` is weight group ``g = s * E + e`` of the free
views ``[N * E, R, in]`` / ``[N * E, out, R]``. Slot ranks and scales are per slot, as in
:class:`~miles_multilora.lora.layer.MultiLoRALinear`, which this class extends so that every slot
operation (init, clear, checkpoint state, PEFT export and load, the per-slot optimizer) covers the
experts' LoRA too. The layer holds no base weight: the experts module of the MoE layer
(:mod:`~miles_multilora.lora.moe`) runs the base GEMMs and calls :meth:`add_lora` (one routed pass
over all (slot, expert) groups of a micro-batch) or :meth:`add_lora_rows` (a decode step).

Experts are whole on each rank (expert tensor parallelism 1); with expert parallelism the layer
holds the ``E`` local experts of ``num_experts``, from global index ``expert_offset``.
"""

from __future__ import annotations

import torch
from torch import nn

from miles_multilora.errors import ConfigError
from miles_multilora.lora import routed_ops
from miles_multilora.lora import triton_kernels as tk
from miles_multilora.lora.expert_routing import SLOT_MAJOR, ExpertPlan, check_order
from miles_multilora.lora.kernels import add_rows_, gather_rows, segmented_matmul
from miles_multilora.lora.layer import COLUMN, ROW, MultiLoRALinear, _writable, check_kernels
from miles_multilora.lora.row_routing import RowRouting

EXPERT_PROJECTIONS = ("linear_fc1", "linear_fc2")


class MultiLoRAExpertLinear(MultiLoRALinear):
    """LoRA slots of projection ``proj`` of ``num_local_experts`` experts (no base weight of its own).

    ``in_features``/``out_features``: one expert's projection; ``shared_a``: one ``A`` per slot for
    every expert (only ``B`` is per expert); ``order``: how the (slot, expert) groups' rows are
    ordered (:mod:`~miles_multilora.lora.expert_routing`); ``rank_divisor``: a fresh slot of rank
    ``r`` gets rank ``r / rank_divisor`` here at the adapter's alpha (``lora.expert_rank_scaling``).
    """

    stacks_shrink = False  # no base GEMM to carry the A rows (lora.stacked_shrink)

    def __init__(
        self,
        proj: str,
        in_features: int,
        out_features: int,
        num_local_experts: int,
        num_slots: int,
        max_rank: int,
        key: str,
        config=None,
        expert_offset: int = 0,
        num_experts: int | None = None,
        shared_a: bool = False,
        order: str = SLOT_MAJOR,
        rank_divisor: int = 1,
        kernels: str = "auto",
        ep_group=None,
        expert_dp_group=None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        nn.Module.__init__(self)
        if proj not in EXPERT_PROJECTIONS:
            raise ConfigError("target_modules", f"expert projections are {EXPERT_PROJECTIONS}, got {proj!r}")
        if num_slots < 1:
            raise ConfigError("num_slots", f"must be >= 1, got {num_slots}")
        if max_rank < 1:
            raise ConfigError("max_rank", f"must be >= 1, got {max_rank}")
        self.kernels = check_kernels(kernels)
        self.order = check_order(order)
        self.proj = proj
        self.kind = COLUMN if proj == "linear_fc1" else ROW
        self.base = None
        self.config = config
        self.key = key
        self.num_slots, self.max_rank = num_slots, max_rank
        self.num_local_experts = num_local_experts
        self.num_experts = num_experts if num_experts is not None else num_local_experts
        self.expert_offset = expert_offset
        self.shared_a = shared_a
        self.rank_divisor = rank_divisor
        self.batch_first = False
        self.tp_group, self.tp_size, self.tp_rank = None, 1, 0  # experts are whole on each rank
        self.ep_group = ep_group
        # the replicas of these experts that see other tokens, over which their gradients are summed:
        # the dense layers' DP group without expert parallelism, else the expert-data-parallel group
        self.expert_dp_group = expert_dp_group
        self.in_features = self.full_in_features = in_features
        self.out_features = self.full_out_features = out_features
        a_experts = 1 if shared_a else num_local_experts
        self.lora_A = nn.Parameter(
            torch.zeros(num_slots, a_experts, max_rank, in_features, device=device, dtype=dtype)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(num_slots, num_local_experts, out_features, max_rank, device=device, dtype=dtype)
        )
        ep_split = num_local_experts < self.num_experts
        self.lora_A.tp_sharded = self.lora_B.tp_sharded = False  # type: ignore[attr-defined]
        # the optimizer's grad norm sums these over the expert-parallel group (each rank holds its experts)
        self.lora_A.ep_sharded = ep_split and not shared_a  # type: ignore[attr-defined]
        self.lora_B.ep_sharded = ep_split  # type: ignore[attr-defined]
        self.slot_rank = [0] * num_slots
        self.slot_scale = [0.0] * num_slots
        self.register_buffer(
            "lora_scale", torch.zeros(num_slots, dtype=torch.float32, device=device), persistent=False
        )
        self.routing = None  # the model's token routing (set_token_slots / a decode step's rows)
        self.stacked_weight = None

    def set_fp8_base(self, enabled: bool) -> None:
        if enabled:
            raise ConfigError(
                "model.base_precision",
                f"{self.key}: expert layers have no FP8 path; fp8 is for dense models (use base_precision=dtype)",
            )

    def current_stack(self) -> None:
        return None

    # ----- weight views -----
    def _a(self) -> torch.Tensor:
        return self.lora_A.view(-1, self.max_rank, self.in_features)

    def _b(self) -> torch.Tensor:
        return self.lora_B.view(-1, self.out_features, self.max_rank)

    def group_scales(self) -> torch.Tensor:
        """fp32 scale of every weight group ``s * E + e``: ``[N * E]``."""
        return self.lora_scale.repeat_interleave(self.num_local_experts)

    def _a_scales(self) -> torch.Tensor:
        return self.lora_scale if self.shared_a else self.group_scales()

    # ----- a micro-batch: rows sorted by expert, one routed pass -----
    def add_lora(self, x: torch.Tensor, out: torch.Tensor, plan: ExpertPlan) -> torch.Tensor:
        """``out[i] += scale_s * B_{s,e} A_{s,e} x[i]`` for every routed row ``i`` (slot ``s``, expert
        ``e``): ``x`` ``[T, in]``, ``out`` ``[T, out]``; in place when ``out`` allows it."""
        if plan.num_routed == 0:
            return out
        a_plan = plan.shared if self.shared_a else plan.groups
        assert a_plan is not None, "a shared-A layer needs a plan built with shared_a=True"
        if self._use_triton(x):
            x2d = x if x.stride(-1) == 1 else x.contiguous()
            h = routed_ops.gather_shrink(x2d, self._a(), self._a_scales(), a_plan, a_plan.order)
            if plan.shared_to_groups is not None:
                h = h.index_select(0, plan.shared_to_groups)
            return routed_ops.scatter_expand_add_(
                _writable(out), h.contiguous(), self._b(), plan.groups, plan.groups.order
            )
        h = segmented_matmul(gather_rows(x, a_plan.order), self._a(), a_plan)
        scale = self._a_scales().index_select(0, a_plan.sorted_slots).unsqueeze(1)
        h = (h.float() * scale).to(h.dtype)
        if plan.shared_to_groups is not None:
            h = h.index_select(0, plan.shared_to_groups)
        delta = segmented_matmul(h, self._b(), plan.groups).to(out.dtype)
        if out._base is None and out.is_contiguous():
            return add_rows_(out, plan.groups.order, delta)
        return out.index_add(0, plan.groups.order, delta)

    # ----- a decode step: one row per (token, chosen expert), groups from a device tensor -----
    def add_lora_rows(self, x: torch.Tensor, out: torch.Tensor, routing: RowRouting) -> torch.Tensor:
        """In place ``out[i] += scale_s * B_g A_g x[i]`` with ``g = routing.row_slots[i]`` the row's
        weight group (``-1``: none). No host sync (capturable)."""
        groups = routing.row_slots
        if self._use_triton(x) and not self.shared_a:
            cfg = tk.DECODE_SHRINK_CONFIG
            a = self._a()
            parts = tk.split_shrink(
                x.contiguous(), routing.order, a, (a.stride(0), a.stride(1), a.stride(2)), self.max_rank,
                routing.tiles[cfg["BLOCK_M"]], cfg, routing.rows, self.group_scales(),
            )  # fmt: skip
            tk.decode_expand(out, parts, routing.order, routing.tiles, self._b(), accumulate=True)
            return out
        index = groups.clamp(min=0)
        a_index = torch.div(index, self.num_local_experts, rounding_mode="floor") if self.shared_a else index
        h = torch.bmm(self._a().index_select(0, a_index), x.unsqueeze(-1)).squeeze(-1)
        scale = self.group_scales().index_select(0, index) * (groups >= 0)  # no group adds exactly 0
        h = (h.float() * scale.unsqueeze(1)).to(out.dtype)
        delta = torch.bmm(self._b().index_select(0, index).to(out.dtype), h.unsqueeze(-1)).squeeze(-1)
        return out.add_(delta)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.key}: expert LoRA is applied by its MoE layer's experts module")

    def extra_repr(self) -> str:
        return (
            f"key={self.key!r}, experts={self.num_local_experts}/{self.num_experts} "
            f"(from {self.expert_offset}), slots={self.num_slots}, max_rank={self.max_rank}, "
            f"in={self.in_features}, out={self.out_features}, shared_a={self.shared_a}, "
            f"order={self.order}, kernels={self.kernels}"
        )
