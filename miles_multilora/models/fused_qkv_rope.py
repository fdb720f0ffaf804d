"""The QKV split and RoPE in one Triton kernel each way (training on a GPU).

Megatron splits the fused QKV projection's output into query, key and value, copies the query
(its heads are strided across the groups) and rotates query and key; its backward rotates the two
gradients back and concatenates all three into the projection's gradient. That is five kernels and
three passes over the activations per layer. Megatron skips the split when
``config.fused_single_qkv_rope`` is set, and hands the unsplit output to Transformer Engine's
``apply_fused_qkv_rotary_pos_emb``; without TE that hook is missing, and
:func:`miles_multilora.models.compat.install_fused_qkv_rope` fills it with
:func:`apply_fused_qkv_rope`. One program per token reads the token's whole QKV row once, takes the
angles' cos and sin once, and writes a contiguous rotated query, rotated key and value; the
backward writes the projection's gradient in one pass the same way. The rounding is
:mod:`~miles_multilora.models.fused_rope`'s, so both paths give the same bits.

:func:`eligible` says whether a model's attention can take this path on every call (Megatron
asserts otherwise); :func:`apply_fused_qkv_rope` runs the split and RoPE unfused for inputs the
kernel does not cover.
"""

from __future__ import annotations

import torch

from miles_multilora._triton import HAVE_TRITON, tl, triton
from miles_multilora.models import fused_rope

if HAVE_TRITON:
    from miles_multilora.models.fused_rope import token_angles

    @triton.jit
    def _qkv_rope_kernel(
        qkv_ptr, freqs_ptr, q_ptr, k_ptr, v_ptr, stride_s, stride_b, stride_g, stride_f, BATCH,
        GROUPS: tl.constexpr, QPG: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        """One token (``row = s * BATCH + b``): its ``GROUPS x (QPG + 2)`` heads (each group's
        query heads, then its key, then its value) into ``q`` ``[rows, GROUPS * QPG, D]`` and
        ``k``/``v`` ``[rows, GROUPS, D]``, query and key rotated."""
        dtype = q_ptr.dtype.element_ty
        row, s, b, lo, hi, c_lo, c_hi, s_lo, s_hi = token_angles(freqs_ptr, stride_f, BATCH, HALF, dtype)
        head = tl.arange(0, HEADS_P2)[:, None]
        valid = head < GROUPS * (QPG + 2)
        g = head // (QPG + 2)
        j = head % (QPG + 2)  # < QPG: a query head; QPG: the key; QPG + 1: the value
        src = qkv_ptr + s * stride_s + b * stride_b + g * stride_g + j * (2 * HALF)
        x_lo = tl.load(src + lo[None, :], mask=valid).to(tl.float32)
        x_hi = tl.load(src + hi[None, :], mask=valid).to(tl.float32)
        rotate = j <= QPG
        y_lo = tl.where(rotate, x_lo * c_lo - x_hi * s_lo, x_lo).to(dtype)
        y_hi = tl.where(rotate, x_hi * c_hi + x_lo * s_hi, x_hi).to(dtype)
        q_dst = q_ptr + ((row * GROUPS + g) * QPG + j) * (2 * HALF)
        kv_off = (row * GROUPS + g) * (2 * HALF)
        is_q = valid & (j < QPG)
        is_k = valid & (j == QPG)
        is_v = valid & (j == QPG + 1)
        tl.store(q_dst + lo[None, :], y_lo, mask=is_q)
        tl.store(q_dst + hi[None, :], y_hi, mask=is_q)
        tl.store(k_ptr + kv_off + lo[None, :], y_lo, mask=is_k)
        tl.store(k_ptr + kv_off + hi[None, :], y_hi, mask=is_k)
        tl.store(v_ptr + kv_off + lo[None, :], y_lo, mask=is_v)
        tl.store(v_ptr + kv_off + hi[None, :], y_hi, mask=is_v)

    @triton.jit
    def _qkv_rope_grad_kernel(
        dq_ptr, dk_ptr, dv_ptr, freqs_ptr, out_ptr,
        dq_s, dq_b, dq_h, dk_s, dk_b, dk_h, dv_s, dv_b, dv_h, stride_f, BATCH,
        GROUPS: tl.constexpr, QPG: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        """The backward of :func:`_qkv_rope_kernel` for one token: the query and key gradients
        rotated back and the value gradient, into the QKV row's layout."""
        dtype = out_ptr.dtype.element_ty
        row, s, b, lo, hi, c_lo, c_hi, s_lo, s_hi = token_angles(freqs_ptr, stride_f, BATCH, HALF, dtype)
        head = tl.arange(0, HEADS_P2)[:, None]
        valid = head < GROUPS * (QPG + 2)
        g = head // (QPG + 2)
        j = head % (QPG + 2)
        is_q = valid & (j < QPG)
        is_k = valid & (j == QPG)
        is_v = valid & (j == QPG + 1)
        q_src = dq_ptr + s * dq_s + b * dq_b + (g * QPG + j) * dq_h
        k_src = dk_ptr + s * dk_s + b * dk_b + g * dk_h
        v_src = dv_ptr + s * dv_s + b * dv_b + g * dv_h
        x_lo = (
            tl.load(q_src + lo[None, :], mask=is_q, other=0.0).to(tl.float32)
            + tl.load(k_src + lo[None, :], mask=is_k, other=0.0).to(tl.float32)
            + tl.load(v_src + lo[None, :], mask=is_v, other=0.0).to(tl.float32)
        )
        x_hi = (
            tl.load(q_src + hi[None, :], mask=is_q, other=0.0).to(tl.float32)
            + tl.load(k_src + hi[None, :], mask=is_k, other=0.0).to(tl.float32)
            + tl.load(v_src + hi[None, :], mask=is_v, other=0.0).to(tl.float32)
        )
        rotate = j <= QPG  # the transposed rotation
        y_lo = tl.where(rotate, x_lo * c_lo + x_hi * s_hi, x_lo)
        y_hi = tl.where(rotate, x_hi * c_hi - x_lo * s_lo, x_hi)
        dst = out_ptr + (row * GROUPS * (QPG + 2) + head) * (2 * HALF)
        tl.store(dst + lo[None, :], y_lo.to(dtype), mask=valid)
        tl.store(dst + hi[None, :], y_hi.to(dtype), mask=valid)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _FusedQKVRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, freqs, query_heads_per_group: int):  # type: ignore[override]
        """``qkv`` ``[s, b, groups, (qpg + 2) * d]`` (its last dim contiguous), ``freqs`` ``[s, d]``
        -> ``q`` ``[s, b, groups * qpg, d]``, ``k``, ``v`` ``[s, b, groups, d]``, all contiguous."""
        seq, batch, groups, width = qkv.shape
        qpg = query_heads_per_group
        dim = width // (qpg + 2)
        q = torch.empty(seq, batch, groups * qpg, dim, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty(seq, batch, groups, dim, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        _qkv_rope_kernel[(seq * batch,)](
            qkv, freqs, q, k, v, qkv.stride(0), qkv.stride(1), qkv.stride(2), freqs.stride(0), batch,
            GROUPS=groups, QPG=qpg, HEADS_P2=triton.next_power_of_2(groups * (qpg + 2)), HALF=dim // 2,
        )  # fmt: skip
        ctx.save_for_backward(freqs)
        ctx.qpg = qpg
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):  # type: ignore[override]
        (freqs,) = ctx.saved_tensors
        seq, batch, groups, dim = dk.shape
        qpg = ctx.qpg
        dq, dk, dv = (_last_dim_contiguous(t) for t in (dq, dk, dv))
        out = torch.empty(seq, batch, groups, (qpg + 2) * dim, dtype=dk.dtype, device=dk.device)
        _qkv_rope_grad_kernel[(seq * batch,)](
            dq, dk, dv, freqs, out,
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), freqs.stride(0), batch,
            GROUPS=groups, QPG=qpg, HEADS_P2=triton.next_power_of_2(groups * (qpg + 2)), HALF=dim // 2,
        )  # fmt: skip
        return out, None, None


def _kernel_applies(
    qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, split: list[int]
) -> bool:
    if len(split) != 3 or split[1] != split[2] or split[0] % split[1] or qkv.dim() != 4:
        return False
    return (
        HAVE_TRITON
        and qkv.is_cuda
        and qkv.shape[-1] == sum(split)
        and qkv.stride(-1) == 1
        and q_freqs is k_freqs  # Megatron passes one table twice (comparing values would sync the GPU)
        and fused_rope.rotates(q_freqs, qkv.shape[0], split[1])
    )


def apply_fused_qkv_rope(
    qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, split: list[int], *args, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused-QKV-RoPE hook: the unsplit ``qkv`` ``[s, b, groups, (qpg + 2) * d]`` with
    ``split`` ``[qpg * d, d, d]`` -> rotated ``query`` ``[s, b, heads, d]``, rotated ``key`` and
    ``value`` ``[s, b, groups, d]``; ``freqs`` ``[s, 1, 1, d]`` (non-interleaved RoPE)."""
    if args or kwargs:
        raise NotImplementedError(
            "the fused QKV RoPE takes only sbhd, non-interleaved RoPE without context parallelism "
            f"(got extra arguments {args} {sorted(kwargs)})"
        )
    if not _kernel_applies(qkv, q_freqs, k_freqs, split):  # Megatron's split, then RoPE on q and k
        query, key, value = torch.split(qkv, split, dim=3)
        query = query.reshape(*query.shape[:2], -1, split[1])
        return fused_rope.apply_rope(query, q_freqs), fused_rope.apply_rope(key, k_freqs), value
    flat = q_freqs[: qkv.shape[0]].reshape(qkv.shape[0], -1)
    return _FusedQKVRoPE.apply(qkv, _last_dim_contiguous(flat), split[0] // split[1])


# config flags under which Megatron's attention splits the QKV output itself (or asserts)
_SPLIT_FLAGS = (
    "rotary_interleaved",
    "multi_latent_attention",
    "attention_output_gate",
    "test_mode",
    "flash_decode",
)


def eligible(model: torch.nn.Module) -> bool:
    """Whether every self-attention call of ``model`` can take Megatron's unsplit QKV path: plain
    non-interleaved RoPE, no query/key norms, no output gate, whole query groups on each TP rank."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    config = getattr(model, "config", None)
    attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
    if config is None or not attentions or getattr(model, "position_embedding_type", None) != "rope":
        return False
    if hasattr(config, "yarn_rotary_scaling_factor"):
        return False
    tp = config.tensor_model_parallel_size or 1
    return (
        not any(getattr(config, flag, False) for flag in _SPLIT_FLAGS)
        and (config.num_query_groups or config.num_attention_heads) >= tp
        and all(
            (a.q_layernorm is None or isinstance(a.q_layernorm, IdentityOp))
            and (a.k_layernorm is None or isinstance(a.k_layernorm, IdentityOp))
            for a in attentions
        )
    )
