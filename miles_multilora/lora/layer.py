"""MultiLoRALinear: N LoRA slots resident next to one frozen base linear layer.

``lora_A`` is ``[N, R, in]`` and ``lora_B`` is ``[N, out, R]`` (stacked once, never re-stacked).
Slot ``s`` has its own rank ``r_s <= R`` (rows/columns past ``r_s`` stay zero, so they also get a
zero gradient) and scale ``alpha_s / r_s`` kept in fp32. Each token is routed by the model-wide
:class:`~miles_multilora.lora.routing.RoutingPlan`: ``y = base(x) + scale_s * B_s A_s x``.

Tensor parallelism follows the base layer: column-parallel shards ``B``'s out dim (``A``
replicated), row-parallel shards ``A``'s in dim (``B`` replicated). Per layer there is one TP
collective on the rank-R intermediate for all slots: column-parallel all-reduces its gradient in
backward, row-parallel all-reduces it in forward.
"""

from __future__ import annotations

import torch
from torch import nn

from miles_multilora.errors import ConfigError
from miles_multilora.lora import fp8_base, routed_ops, seq_kernels
from miles_multilora.lora import triton_kernels as tk
from miles_multilora.lora.kernels import add_rows_, gather_rows, segmented_matmul
from miles_multilora.lora.routing import RoutingPlan
from miles_multilora.lora.row_delta import RowDelta, RowShrink
from miles_multilora.lora.row_routing import RowRouting
from miles_multilora.lora.triton_kernels import HAVE_TRITON

PLAIN, COLUMN, ROW = "plain", "column", "row"
KERNELS = ("auto", "triton", "torch")


def _base_kind(base: nn.Module) -> str:
    if isinstance(base, nn.Linear):
        return PLAIN
    try:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    except ImportError:  # megatron-core is optional for plain torch use
        ColumnParallelLinear = RowParallelLinear = ()  # type: ignore[assignment,misc]
    if ColumnParallelLinear and isinstance(base, ColumnParallelLinear):
        return COLUMN
    if RowParallelLinear and isinstance(base, RowParallelLinear):
        return ROW
    raise ConfigError(
        "target_modules",
        f"{type(base).__name__} is not supported: MultiLoRA wraps torch.nn.Linear and Megatron "
        "ColumnParallelLinear/RowParallelLinear (use the local layer spec, not Transformer Engine)",
    )


class MultiLoRALinear(nn.Module):
    """Wrap ``base`` (frozen) with ``num_slots`` LoRA slots of rank at most ``max_rank``.

    ``key`` names the layer stably across ranks (used for seeding and export). ``batch_first``
    applies to plain ``nn.Linear`` inputs only (Megatron layers are always sequence-first).
    ``kernels``: ``"auto"`` runs the Triton kernels on CUDA when Triton is installed and the
    PyTorch kernels otherwise; ``"triton"`` always uses Triton (on CPU only under
    ``TRITON_INTERPRET=1``); ``"torch"`` never does.
    """

    stacks_shrink = True  # lora.stacked_shrink may put the slots' A rows under the base weight
    # FP8 copies of the base weight (model.base_precision=fp8): every base GEMM runs on them
    fp8: fp8_base.Fp8Weight | None = None

    def __init__(
        self,
        base: nn.Module,
        num_slots: int,
        max_rank: int,
        key: str = "",
        batch_first: bool = False,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        self.kernels = check_kernels(kernels)
        if num_slots < 1:
            raise ConfigError("num_slots", f"must be >= 1, got {num_slots}")
        if max_rank < 1:
            raise ConfigError("max_rank", f"must be >= 1, got {max_rank}")
        self.kind = _base_kind(base)
        self.base = base
        self.key = key
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.batch_first = batch_first and self.kind == PLAIN
        self.tp_group = None
        self.tp_size, self.tp_rank = 1, 0
        weight = base.weight
        if weight is None:
            raise ConfigError(
                "target_modules",
                f"{key}: the base layer has no own weight (tied embeddings?); drop it from the targets",
            )
        out_local, in_local = weight.shape
        self.in_features, self.out_features = in_local, out_local  # this rank's shard
        self.full_in_features, self.full_out_features = in_local, out_local
        if self.kind != PLAIN:
            self._init_tp(base)
        for p in base.parameters():
            p.requires_grad_(False)
        dev, dtype = weight.device, weight.dtype
        self.lora_A = nn.Parameter(torch.zeros(num_slots, max_rank, in_local, device=dev, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(num_slots, out_local, max_rank, device=dev, dtype=dtype))
        # Which stacked dim (if any) is sharded across TP ranks; the optimizer's norm reads this.
        self.lora_A.tp_sharded = self.kind == ROW and self.tp_size > 1  # type: ignore[attr-defined]
        self.lora_B.tp_sharded = self.kind == COLUMN and self.tp_size > 1  # type: ignore[attr-defined]
        self.slot_rank = [0] * num_slots  # effective rank of each slot in this layer
        self.slot_scale = [0.0] * num_slots  # alpha / rank, exact (Python float)
        self.register_buffer(
            "lora_scale", torch.zeros(num_slots, dtype=torch.float32, device=dev), persistent=False
        )
        self.routing: RoutingPlan | RowRouting | None = None
        # the base weight with every slot's lora_A rows under it, the base weight a view of its top
        # rows (decode steps on a GPU; miles_multilora.lora.stacked_shrink)
        self.stacked_weight: torch.Tensor | None = None

    def _init_tp(self, base: nn.Module) -> None:
        if getattr(base.config, "sequence_parallel", False) and getattr(base, "sequence_parallel", False):
            raise ConfigError(
                "sequence_parallel", "MultiLoRA does not support Megatron sequence parallelism yet"
            )
        if self.kind == COLUMN and getattr(base, "gather_output", False):
            raise ConfigError(
                "target_modules", f"{self.key}: column-parallel layers with gather_output are not supported"
            )
        if self.kind == ROW and not getattr(base, "input_is_parallel", True):
            raise ConfigError(
                "target_modules", f"{self.key}: row-parallel layers need input_is_parallel=True"
            )
        from megatron.core import parallel_state

        group = getattr(base, "tp_group", None)
        if group is None and parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_model_parallel_group()
        self.tp_group = group
        if group is not None and torch.distributed.is_initialized():
            self.tp_size = torch.distributed.get_world_size(group)
            self.tp_rank = torch.distributed.get_rank(group)
        if self.kind == COLUMN:
            self.full_out_features = self.out_features * self.tp_size
        else:
            self.full_in_features = self.in_features * self.tp_size

    # ----- slot bookkeeping (used by miles_multilora.lora.slots) -----
    def set_slot_scale(self, slot: int, rank: int, scale: float) -> None:
        """Record slot ``slot``'s effective rank and exact scale in this layer."""
        self.slot_rank[slot] = rank
        self.slot_scale[slot] = float(scale)
        with torch.no_grad():
            self.lora_scale[slot] = float(scale)  # rounded once to fp32, as PEFT's fp32 multiply does

    def _apply(self, fn, recurse=True):  # keep the scales fp32 whatever dtype the model is cast to
        super()._apply(fn, recurse)
        self.lora_scale = torch.tensor(self.slot_scale, dtype=torch.float32, device=self.lora_A.device)
        if self.current_stack() is None:
            self.stacked_weight = None  # the base weight moved: free the stale stack
        return self

    # ----- forward -----
    def _lora_delta(self, x2d: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """LoRA output for the routed tokens, in the plan's grouped order: [num_routed, out_local]."""
        xs = gather_rows(x2d, plan.token_order(self.batch_first))
        h = self._tp_h(segmented_matmul(xs, self.lora_A, plan))  # [Tr, R]; partial sum when row-parallel
        scale = self.lora_scale.index_select(0, plan.sorted_slots).unsqueeze(1)
        h = (h.float() * scale).to(h.dtype)
        return segmented_matmul(h, self.lora_B, plan)

    def _tp_h(self, h: torch.Tensor) -> torch.Tensor:
        """The one TP collective of the layer, on the rank-R intermediate."""
        if self.tp_size > 1:
            from megatron.core.tensor_parallel import mappings

            if self.kind == ROW:
                return mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            return mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return h

    def _use_triton(self, x: torch.Tensor) -> bool:
        if self.kernels == "torch" or x.dtype != self.lora_A.dtype:
            return False
        if self.kernels == "triton":
            return True
        return HAVE_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def _add_lora_triton(self, x: torch.Tensor, out: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """Triton kernels read and write the routed activation rows in place (:mod:`routed_ops`)."""
        rows = plan.token_order(self.batch_first)
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        h = self._tp_h(routed_ops.gather_shrink(x2d, self.lora_A, self.lora_scale, plan, rows))
        out = _writable(out)
        return routed_ops.scatter_expand_add_(out, h, self.lora_B, plan, rows)

    def _add_lora_per_sequence(self, x: torch.Tensor, out: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """Every sequence has one slot: gather the (small) A/B of each sequence and run batched GEMMs
        directly on the sequence-first activations (see :mod:`seq_kernels`): no row gather/scatter."""
        assert plan.seq_slots is not None
        seq_slots = plan.seq_slots.to(self.lora_A.device, non_blocking=True)  # no-op when already there
        slots = seq_slots.clamp(min=0)
        seq_first = not self.batch_first
        h = self._tp_h(seq_kernels.shrink(x, self.lora_A.index_select(0, slots), seq_first))  # [B, S, R]
        scale = self.lora_scale.index_select(0, slots) * (seq_slots >= 0)  # slot -1 adds exactly 0
        h = (h.float() * scale.view(-1, 1, 1)).to(out.dtype)
        b = self.lora_B.index_select(0, slots).to(out.dtype)  # [B, out_local, R]
        if out._base is None and out.is_contiguous():  # a fresh output no backward needs: accumulate in place
            return seq_kernels.expand_add_(out, h, b, seq_first)
        delta = torch.bmm(h, b.transpose(1, 2))  # [B, S, out_local]
        return out + (delta.transpose(0, 1) if seq_first else delta)

    def _add_lora_rows(self, x: torch.Tensor, out: torch.Tensor, plan: RowRouting) -> torch.Tensor:
        """One token per row, slots from a device tensor (decode steps; no host sync)."""
        if self._use_triton(x):
            return self._row_expand(out, self._row_shrink(x, plan), plan)
        x2d = self._row_input(x, plan)
        out = _writable(out)
        out2d = out.view(-1, out.shape[-1])
        slots = plan.row_slots
        index = slots.clamp(min=0)
        h = self._tp_h(torch.bmm(self.lora_A.index_select(0, index), x2d.unsqueeze(-1)).squeeze(-1))
        scale = self.lora_scale.index_select(0, index) * (slots >= 0)  # slot -1 adds exactly 0
        h = (h.float() * scale.unsqueeze(1)).to(out.dtype)
        delta = torch.bmm(self.lora_B.index_select(0, index).to(out.dtype), h.unsqueeze(-1)).squeeze(-1)
        return out2d.add_(delta).view(out.shape)

    def _row_input(self, x: torch.Tensor, plan: RowRouting) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[0] != plan.rows:
            raise ConfigError(
                "row_slots", f"routes {plan.rows} rows but layer {self.key or ''} got {x2d.shape[0]} tokens"
            )
        return x2d

    def _row_shrink(self, x: torch.Tensor, plan: RowRouting) -> torch.Tensor:
        """Triton decode shrink: fp32 split-K partials ``scale * x @ A^T`` per row (its slot); with
        ``plan.dense_shrink``, ``x @ A^T`` of every slot ``[rows, slots * R]`` in one GEMM."""
        if plan.dense_shrink:
            a = self.lora_A.view(-1, self.lora_A.shape[-1])  # [slots * R, in]: a free view
            return self._row_input(x, plan) @ a.t()
        cfg, a = tk.DECODE_SHRINK_CONFIG, self.lora_A
        return tk.split_shrink(
            self._row_input(x, plan).contiguous(), plan.order, a, (a.stride(0), a.stride(1), a.stride(2)),
            self.max_rank, plan.tiles[cfg["BLOCK_M"]], cfg, plan.rows, self.lora_scale,
        )  # fmt: skip

    def _row_expand(
        self, out: torch.Tensor, parts: torch.Tensor, plan: RowRouting, accumulate: bool = True
    ) -> torch.Tensor:
        """Triton decode expand: sums the partials (after the layer's TP collective) and adds
        ``h @ B^T`` into the base output rows in place (``accumulate=False``: writes it there)."""
        out = _writable(out, no_grad_alias=not torch.is_grad_enabled())
        tk.decode_expand(
            out.view(-1, out.shape[-1]), self._tp_h(parts), plan.order, plan.tiles, self.lora_B, accumulate,
            dense_scale=self.lora_scale if plan.dense_shrink else None,
        )  # fmt: skip
        return out

    def current_stack(self) -> torch.Tensor | None:
        """The stacked weight if it still holds the base weight, else None (none made yet, or the
        base weight was moved or reassigned since: the stack is stale and must not be read)."""
        stacked = self.stacked_weight
        if stacked is None or self.base.weight.data_ptr() != stacked.data_ptr():
            return None
        return stacked

    def _stacked_forward(self, x: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, h)`` from one GEMM with the stacked weight: the base output (a view of the first
        ``out`` columns, rows strided) and every slot's unscaled shrink ``[rows, slots * R]``."""
        y = torch.nn.functional.linear(x, stacked)
        return y[..., : self.out_features], y.view(-1, y.shape[-1])[:, self.out_features :]

    def _base_forward(
        self, x: torch.Tensor, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.fp8 is not None:
            if args or kwargs:
                raise ConfigError(
                    "model.base_precision",
                    f"{self.key}: an FP8 base takes the input alone, got more arguments",
                )
            out = self._with_bias(fp8_base.fp8_linear(x, self.fp8))
            return (out, None) if self.kind == PLAIN else out
        if self.kind == PLAIN:
            return self.base(x), None
        return self.base(x, *args, **kwargs)

    def set_fp8_base(self, enabled: bool) -> None:
        """Run every base GEMM on FP8 copies of the (frozen) base weight, or again on the weight."""
        if not enabled:
            self.fp8 = None
            return
        if self.tp_size > 1:
            raise ConfigError(
                "model.base_precision", "fp8 needs model.tp=1 (tensor-parallel FP8 GEMMs are not built)"
            )
        self.fp8 = fp8_base.quantize_weight(self.base.weight)

    def _beside_base(self, x: torch.Tensor, plan: RowRouting, args: tuple, kwargs: dict, lora_work):
        """``(out, bias, lora_work())``: the LoRA work on the plan's side stream while the base GEMM
        runs on the main stream (both need only ``x``). The streams meet before returning, and every
        side-stream segment starts after the main stream's work so far, so neither reuses memory the
        other still reads; the fork and join are captured in CUDA graphs."""
        main = torch.cuda.current_stream(x.device)
        side = plan.side_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = lora_work()
        out, bias = self._base_forward(x, args, kwargs)
        main.wait_stream(side)
        return out, bias, result

    def _forward_rows_overlapped(self, x: torch.Tensor, plan: RowRouting, args: tuple, kwargs: dict):
        """Decode on a GPU: the LoRA shrink runs beside the base GEMM, then the expand adds into the
        base output (the path of a caller that does not take a deferred term, and of TP > 1)."""
        out, bias, parts = self._beside_base(x, plan, args, kwargs, lambda: self._row_shrink(x, plan))
        out = self._row_expand(out, parts, plan)
        return out if self.kind == PLAIN else (out, bias)

    def forward_deferred(
        self, x: torch.Tensor, *args, consumer_expands: bool = False, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None, RowDelta | RowShrink | None]:
        """``(out, bias, lora)``: a decode step's forward whose LoRA output is left to the consumer.

        On a GPU with one TP rank and row routing (a decode step):

        * with the routing's ``stacked_shrink`` and a stacked weight (many rows), one GEMM gives the
          base output and the shrink (:mod:`~miles_multilora.lora.stacked_shrink`); the output is a
          row-strided view, and the expand runs into it in place, or is left to a consumer that
          takes it (``consumer_expands``) as a :class:`RowShrink`;
        * ``consumer_expands`` (the consumer can run the expand itself) and the routing's
          ``expand_in_consumer``: the shrink runs on the side stream while the base GEMM runs (or
          after it, without a side stream), and ``lora`` is a :class:`RowShrink`;
        * otherwise, with a side stream (few rows), the shrink and the expand both run there, the
          expand into a new fp32 buffer, and ``lora`` is a :class:`RowDelta`.

        The streams meet before returning, and ``lora`` must be added by whoever reads ``out``.
        Anywhere else this is :meth:`forward` with ``lora`` None.
        """
        plan = self.routing
        rows = isinstance(plan, RowRouting) and self.tp_size == 1 and self._use_triton(x)
        stacked = self.current_stack() if rows and plan.stacked_shrink and self.fp8 is None else None
        if stacked is not None:
            self._row_input(x, plan)  # the row count must match the routing
            out, h = self._stacked_forward(x, stacked)
            if consumer_expands and plan.expand_in_consumer:
                return out, None, RowShrink(h, self.lora_B, plan, self.lora_scale)
            tk.decode_expand(
                out.view(-1, out.shape[-1]), h, plan.order, plan.tiles, self.lora_B, True,
                dense_scale=self.lora_scale,
            )  # fmt: skip
            return out, None, None  # the expand wrote into the strided view in place
        if rows and consumer_expands and plan.expand_in_consumer:
            if plan.side_stream is not None:
                out, bias, h = self._beside_base(x, plan, args, kwargs, lambda: self._row_shrink(x, plan))
            else:
                out, bias = self._base_forward(x, args, kwargs)
                h = self._row_shrink(x, plan)
            dense_scale = self.lora_scale if plan.dense_shrink else None
            return out, bias, RowShrink(h, self.lora_B, plan, dense_scale)
        if not (rows and plan.side_stream is not None):
            result = self.forward(x, *args, **kwargs)
            return (result, None, None) if self.kind == PLAIN else (*result, None)

        def lora_term() -> torch.Tensor:
            delta = torch.empty(plan.rows, self.out_features, device=x.device, dtype=torch.float32)
            return self._row_expand(delta, self._row_shrink(x, plan), plan, accumulate=False)

        out, bias, delta = self._beside_base(x, plan, args, kwargs, lora_term)
        return out, bias, RowDelta(delta, plan.row_slots)

    def _add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        plan = self.routing
        if isinstance(plan, RowRouting):
            return self._add_lora_rows(x, out, plan)
        if plan is None:
            raise RuntimeError(
                f"MultiLoRA layer {self.key or type(self.base).__name__} has no token routing: call "
                "set_token_slots(model, slot_ids) (slot -1 = base only) before the forward"
            )
        tokens = x.numel() // x.shape[-1]
        if tokens != plan.num_tokens:
            raise ConfigError(
                "slot_ids",
                f"routes {plan.num_tokens} tokens ([batch={plan.batch}, seq={plan.seq}]) but layer "
                f"{self.key or ''} got {tokens}: pass slot_ids shaped like input_ids [batch, seq]",
            )
        if plan.num_routed == 0:
            return out
        if self._use_triton(x):
            return self._add_lora_triton(x, out, plan)
        expected = (plan.batch, plan.seq) if self.batch_first else (plan.seq, plan.batch)
        if plan.seq_slots is not None and x.dim() == 3 and tuple(x.shape[:2]) == expected:
            return self._add_lora_per_sequence(x, out, plan)
        delta = self._lora_delta(x.reshape(tokens, x.shape[-1]), plan)
        index, delta = plan.token_order(self.batch_first), delta.to(out.dtype)
        if out._base is None and out.is_contiguous():
            # In place on the base output: a fresh tensor that no backward needs (autograd checks it).
            return add_rows_(out, index, delta)
        # A view (e.g. returned as-is by a custom Function) must not be modified in place.
        return out.reshape(tokens, out.shape[-1]).index_add(0, index, delta).view(out.shape)

    def _one_op_applies(self, x: torch.Tensor, plan: RoutingPlan | RowRouting | None, extra: tuple) -> bool:
        """Whether the base GEMM and the LoRA run as one op (:func:`routed_ops.linear_with_lora`):
        token routing on the Triton path, one TP rank, the base called with ``x`` alone."""
        return (
            isinstance(plan, RoutingPlan)
            and plan.num_routed > 0
            and not any(extra)
            and self.tp_size == 1
            and self._use_triton(x)
            and x.numel() // x.shape[-1] == plan.num_tokens
        )

    def _with_bias(self, out: torch.Tensor):
        """What the base layer returns for its GEMM output ``out``: the bias added, or (Megatron's
        ``skip_bias_add``) returned beside it."""
        bias = self.base.bias
        if self.kind == PLAIN:
            return out if bias is None else out + bias
        if bias is None or self.base.skip_bias_add:
            return out, bias
        return out + bias, None

    def forward(self, x: torch.Tensor, *args, **kwargs):
        plan = self.routing
        if isinstance(plan, RowRouting) and plan.side_stream is not None and self._use_triton(x):
            return self._forward_rows_overlapped(x, plan, args, kwargs)
        if self._one_op_applies(x, plan, (*args, *kwargs.values())):
            assert isinstance(plan, RoutingPlan)
            out = routed_ops.linear_with_lora(
                x, self.base.weight, self.lora_A, self.lora_B, self.lora_scale, plan,
                plan.token_order(self.batch_first), self.fp8,
            )  # fmt: skip
            return self._with_bias(out)
        out, bias = self._base_forward(x, args, kwargs)
        out = self._add_lora(x, out)
        return out if self.kind == PLAIN else (out, bias)

    def extra_repr(self) -> str:
        return (
            f"key={self.key!r}, kind={self.kind}, slots={self.num_slots}, max_rank={self.max_rank}, "
            f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, kernels={self.kernels}"
        )


def _writable(out: torch.Tensor, no_grad_alias: bool = False) -> torch.Tensor:
    """``out`` if the LoRA delta may be added into it in place (a fresh contiguous tensor), else a
    contiguous copy: a view (e.g. returned as-is by a custom Function) must not be modified.

    ``no_grad_alias`` (decode steps, no autograd): a contiguous view of the whole of its base, as
    Megatron's row-parallel layer returns at TP=1 (its identity all-reduce), is written in place.
    """
    if out.is_contiguous() and (out._base is None or (no_grad_alias and _whole_alias(out))):
        return out
    return out.contiguous() if not out.is_contiguous() else out.clone()


def _whole_alias(view: torch.Tensor) -> bool:
    base = view._base
    return base is not None and base.data_ptr() == view.data_ptr() and base.numel() == view.numel()


def check_kernels(kernels: str) -> str:
    """Validate a ``kernels`` choice (``auto``, ``triton`` or ``torch``)."""
    if kernels not in KERNELS:
        raise ConfigError("kernels", f"must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "triton" and not HAVE_TRITON:
        raise ConfigError("kernels", "'triton' needs the triton package: pip install triton, or use 'auto'")
    return kernels
