"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the scores and probabilities ``[B, heads, S, S]``
(and keeps them for the backward); on a GPU that is most of a long micro-batch's activation memory
and a slow unfused softmax. :class:`SDPAttention` is a drop-in subclass that, for the causal
self-attention every model here runs (no mask tensor: causal by the layer's mask type; no dropout,
no window, no softmax offset), calls PyTorch's fused attention instead: the flash kernel on a GPU in
bf16/fp16 (no ``S x S`` tensor, forward or backward), the fused CPU kernel on the CPU. Anything else
falls back to Megatron's implementation unchanged. :func:`causal_attention` is shared with the
rollout engine's prefill.

Right-padded rows need no mask beyond causality: a real token never attends to the padding after it.
Rows packed back to back into one sequence (``models.packed_rows``) attend within their own row:
:func:`packed_causal_attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.nn.attention import SDPBackend, sdpa_kernel

from miles_multilora.errors import ConfigError
from miles_multilora.models import cudnn_attention

if TYPE_CHECKING:
    from miles_multilora.models.packed_rows import PackedRows


class SDPAttention(DotProductAttention):
    """Megatron core attention with a fused causal path (see the module docstring)."""

    fused = True  # tests and benchmarks switch it off to compare with Megatron's path
    packed: PackedRows | None = None  # set by models.packed_rows.packed_rows: rows packed in one sequence

    def _fused_applies(self, query: torch.Tensor, key: torch.Tensor, mask: Any, extra: tuple) -> bool:
        cfg = self.config
        return (
            self.fused
            and all(e is None for e in extra)  # attention bias, packed sequences
            and self.attn_mask_type == AttnMaskType.causal
            and mask is None  # causal by the mask type (Megatron builds the same mask itself)
            and query.shape[0] == key.shape[0]
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
            and not cfg.apply_query_key_layer_scaling
            and not (self.training and self.attention_dropout.p > 0)
        )

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``query`` ``[sq, b, heads, d]``, ``key``/``value`` ``[sk, b, groups, d]`` -> ``[sq, b, heads*d]``."""
        if self.packed is not None:
            return self._packed_forward(
                query, key, value, attention_mask, (attention_bias, packed_seq_params)
            )
        if not self._fused_applies(query, key, attention_mask, (attention_bias, packed_seq_params)):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        seq, batch = query.shape[:2]
        ctx = causal_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), self.softmax_scale
        )
        return ctx.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)

    def _packed_forward(self, query, key, value, mask, extra: tuple) -> torch.Tensor:
        """Rows packed into one sequence (``[T, 1, heads, d]``): causal attention within each row."""
        packed = self.packed
        assert packed is not None
        if (
            query.shape[1] != 1
            or query.shape[0] != packed.total
            or not self._fused_applies(query, key, mask, extra)
        ):
            raise RuntimeError(
                f"packed rows need the fused causal attention on one sequence of {packed.total} tokens, "
                f"got query {tuple(query.shape)} (packing_applies should have refused this model)"
            )
        # squeeze, not [:, 0]: a selection's backward writes a zero-filled copy of each input's gradient
        ctx = packed_causal_attention(
            query.squeeze(1), key.squeeze(1), value.squeeze(1), packed, self.softmax_scale
        )
        return ctx.reshape(query.shape[0], 1, self.hidden_size_per_partition)


# cuDNN's fused attention compiles a kernel per shape (tens of ms, forward and backward); training
# micro-batches and prefills change shape every step, so the shape-generic kernels are used.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[b, heads, s, d]`` over ``k``/``v`` ``[b, groups, s, d]`` (grouped
    query heads share a group), with PyTorch's fused kernels other than cuDNN's."""
    with sdpa_kernel(_BACKENDS):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedRows, scale: float | None
) -> torch.Tensor:
    """Causal attention within each packed row: ``q`` ``[T, heads, d]`` over ``k``/``v``
    ``[T, groups, d]`` -> ``[T, heads, d]``. On a GPU in 16-bit floats cuDNN's fused attention where
    ``trainer.attention`` takes it (:func:`_use_cudnn`), else PyTorch's variable-length flash kernel
    (one launch over every row); otherwise the fused kernel row by row."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = _cudnn_attention(q, k, v, packed, scale)
        if out is not None:
            return out
        longest, cu = packed.longest, packed.cu_seqlens
        # ATen's op itself (its backward is ATen's too): torch.nn.attention.varlen wraps it in a
        # Python custom op, whose dispatch costs host time at every layer, forward and backward
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale
        )
        return out[0]
    rows = []
    for start, n in zip(packed.starts, packed.lengths, strict=True):
        row = [t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, heads, n, d]
        rows.append(causal_attention(*row, scale)[0].transpose(0, 1))
    return torch.cat(rows)


# cuDNN's kernels beat the flash kernel on micro-batches of long rows and lose on many short ones
# (H200, forward + backward: 1.55x at 4 rows x 4000 tokens, 1.21x at 6 x 2700, 0.97x at 16 x 1000,
# 0.59x at 40 x 400; docs/benchmarks.md): ``auto`` takes cuDNN from this longest row on
CUDNN_MIN_LONGEST = 2048


def _use_cudnn(q: torch.Tensor, packed: PackedRows) -> bool:
    """Whether ``packed``'s attention runs on cuDNN (``trainer.attention``; see CUDNN_MIN_LONGEST)."""
    if packed.attention == "flash":
        return False
    if not cudnn_attention.available(q):
        if packed.attention == "cudnn":
            raise ConfigError(
                "trainer.attention",
                "cudnn needs the cuDNN frontend (pip install nvidia-cudnn-frontend) and a Hopper or newer "
                "GPU; use auto or flash",
            )
        return False
    return packed.attention == "cudnn" or packed.longest >= CUDNN_MIN_LONGEST


def _cudnn_attention(q, k, v, packed: PackedRows, scale: float | None) -> torch.Tensor | None:
    """cuDNN's attention of the packed rows, or None where the flash kernel runs them (not chosen,
    or, with ``auto``, a shape cuDNN cannot build)."""
    if not _use_cudnn(q, packed):
        return None
    try:
        return cudnn_attention.packed_attention(
            q, k, v, packed.cu_seqlens, packed.longest,
            scale if scale is not None else q.shape[-1] ** -0.5, packed.attention_cache,
        )  # fmt: skip
    except cudnn_attention.NotSupported as exc:
        if packed.attention == "cudnn":
            raise ConfigError(
                "trainer.attention", f"cuDNN cannot run this model's attention ({exc}); use auto or flash"
            ) from exc
        return None


def with_sdpa_attention(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a GPT layer spec) with its core attention replaced by :class:`SDPAttention`."""
    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is DotProductAttention:
        attention.core_attention = SDPAttention
    return spec


def set_fused_attention(model: torch.nn.Module, enabled: bool) -> None:
    """Switch every :class:`SDPAttention` of ``model`` between the fused path and Megatron's."""
    for module in model.modules():
        if isinstance(module, SDPAttention):
            module.fused = enabled
