"""Training rows packed into one sequence: no padding, attention within each row.

A right-padded micro-batch ``[rows, longest]`` computes ``rows x longest`` tokens, and Megatron's
``[seq, batch]`` layout makes the attention's inputs and output strided copies of it. Packed, the
micro-batch is one sequence of exactly the rows' tokens (``[1, T]``): every GEMM, norm and LoRA pass
runs on real tokens only, the attention runs PyTorch's variable-length flash kernel over the rows'
boundaries (``cu_seqlens``), and each token's rotary angle is its position within its row.

:func:`packed_rows` switches a model into this layout for a forward (and the backward that
recomputes it): the fused core attention (:class:`~miles_multilora.models.sdpa_attention.SDPAttention`)
attends within rows, and the rotary table Megatron builds for positions ``0..T-1`` is re-indexed by
the in-row positions. :func:`packing_applies` says whether a model can run packed (every core
attention fused, plain RoPE or none, no MoE layers); where it cannot, the trainer pads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from miles_multilora.host_tensors import to_device
from miles_multilora.models.provider import gpt_module
from miles_multilora.models.sdpa_attention import SDPAttention


@dataclass
class PackedRows:
    """Where each row sits in the packed sequence: ``starts[i]`` (host) and ``lengths[i]``, with the
    device tensors the kernels take (``cu_seqlens`` int32 ``[rows + 1]``, in-row positions ``[T]``)."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    row_starts: torch.Tensor  # [rows] long: ``starts`` on the device (maps (row, position) to a token)
    attention: str = "auto"  # the attention kernel on a GPU (trainer.attention)
    # per micro-batch tensors the attention kernel derives from ``cu_seqlens`` (shared by every layer)
    attention_cache: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.starts[-1] + self.lengths[-1] if self.lengths else 0

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)


def pack_rows(
    sequences: Sequence[Sequence[int]], device: torch.device | str, attention: str = "auto"
) -> tuple[torch.Tensor, PackedRows]:
    """``input_ids`` ``[1, T]`` of ``sequences`` back to back, and where each row sits (``attention``:
    the attention kernel on a GPU, ``trainer.attention``)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("pack_rows needs at least one sequence and no empty sequence")
    lengths = tuple(len(s) for s in sequences)
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long).view(1, -1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([*starts, total], dtype=torch.int32)
    packed = PackedRows(
        lengths=lengths,
        starts=tuple(starts),
        cu_seqlens=to_device(cu, device),
        positions=to_device(positions, device),
        row_starts=to_device(torch.tensor(starts, dtype=torch.long), device),
        attention=attention,
    )
    return to_device(ids, device), packed


def packing_applies(model: torch.nn.Module) -> bool:
    """Whether ``model`` can run :func:`packed_rows`: every core attention is the fused causal one
    (:class:`SDPAttention` with ``fused`` on), the positions are plain RoPE (or none), no MoE."""
    gpt = gpt_module(model)
    config = getattr(gpt, "config", None)
    if (
        config is None
        or getattr(config, "num_moe_experts", None)
        or getattr(config, "multi_latent_attention", False)
    ):
        return False  # MoE token dispatch and latent attention are not checked packed
    if getattr(gpt, "position_embedding_type", None) not in ("rope", "none"):
        return False
    attentions = _core_attentions(gpt)
    return bool(attentions) and all(isinstance(m, SDPAttention) and m.fused for m in attentions)


def _core_attentions(gpt: torch.nn.Module) -> list[torch.nn.Module]:
    """Every core attention of ``gpt`` (found once per model: a traversal per micro-batch is host
    time): Megatron's own and Transformer Engine's, which see no row boundaries, and ours."""
    found = getattr(gpt, "_miles_core_attentions", None)
    if found is None:
        found = [
            m
            for m in gpt.modules()
            if isinstance(m, DotProductAttention) or type(m).__name__.endswith("DotProductAttention")
        ]
        gpt._miles_core_attentions = found  # a plain attribute: not a submodule, not in the state dict
    return found


@contextmanager
def packed_rows(model: torch.nn.Module, packed: PackedRows) -> Iterator[None]:
    """Run ``model`` on a packed ``[1, T]`` sequence laid out by ``packed`` (see the module
    docstring); restores the padded layout on exit. Keep it open through the backward when
    activations are recomputed (the recompute runs the forward again)."""
    if not packing_applies(model):
        raise RuntimeError("this model cannot run packed rows (packing_applies is False): pad the rows")
    gpt = gpt_module(model)
    attentions = [m for m in _core_attentions(gpt) if isinstance(m, SDPAttention)]
    hook = None
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is not None:

        def in_row_angles(_module, _args, table):  # [T, 1, 1, d] for positions 0..T-1 -> in-row positions
            return table.index_select(0, packed.positions)

        hook = rotary.register_forward_hook(in_row_angles)
    for attention in attentions:
        attention.packed = packed
    try:
        yield
    finally:
        for attention in attentions:
            attention.packed = None
        if hook is not None:
            hook.remove()
