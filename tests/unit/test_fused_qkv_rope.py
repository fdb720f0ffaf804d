"""The QKV split and RoPE in one kernel (models/fused_qkv_rope.py) equal Megatron's split followed by
its RoPE, forward and backward; which models take it; training with it equals training without."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention

from miles_multilora.models import compat, fused_qkv_rope
from miles_multilora.models.provider import build_tiny_gpt, gpt_module, set_fused_kernels
from tests.helpers import assert_close_at_scale

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
needs_triton = pytest.mark.skipif(not fused_qkv_rope.HAVE_TRITON, reason="triton is not installed")
GROUPS, QPG, DIM = 2, 3, 16
SPLIT = [QPG * DIM, DIM, DIM]


def _freqs(seq: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.outer(torch.arange(seq).float(), inv)
    return torch.cat([f, f], dim=-1).view(seq, 1, 1, dim)  # Megatron's non-interleaved layout


def _megatron(qkv: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Megatron's path without the fused hooks: split, the query's reshape, the unfused RoPE."""
    query, key, value = torch.split(qkv, SPLIT, dim=3)
    query = query.reshape(*query.shape[:2], -1, DIM)
    return (
        rope_utils._apply_rotary_pos_emb_bshd(query, freqs[: qkv.shape[0]]),
        rope_utils._apply_rotary_pos_emb_bshd(key, freqs[: qkv.shape[0]]),
        value,
    )


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_the_kernels_equal_megatrons_split_and_rope(device: str) -> None:
    """Outputs, and the QKV gradient from non-contiguous output gradients; the QKV input a strided
    view (as a wider projection's output would be)."""
    gen = torch.Generator().manual_seed(0)
    seq, batch = 7, 2
    wide = torch.randn(seq, batch, GROUPS, sum(SPLIT) + 8, generator=gen).to(device)
    freqs = _freqs(9, DIM).to(device)
    # output gradients as transposed views: the backward reads them through their strides
    grads = [
        torch.randn(heads, DIM, batch, seq, generator=gen).to(device).permute(3, 2, 0, 1)
        for heads in (GROUPS * QPG, GROUPS, GROUPS)
    ]
    results = []
    for fused in (True, False):
        leaf = wide.clone().requires_grad_(True)
        qkv = leaf[..., : sum(SPLIT)]
        outs = (
            fused_qkv_rope._FusedQKVRoPE.apply(qkv, freqs[:seq].reshape(seq, -1), QPG)
            if fused
            else _megatron(qkv, freqs)
        )
        torch.autograd.backward(outs, grads)
        results.append(([o.detach() for o in outs], leaf.grad))
    (outs_f, grad_f), (outs_m, grad_m) = results
    for got, want in zip(outs_f, outs_m, strict=True):
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_close_at_scale(grad_f, grad_m, 1e-5, "qkv grad")
    assert grad_f[..., sum(SPLIT) :].abs().max() == 0


def test_the_hook_falls_back_to_the_split_where_the_kernel_does_not_apply() -> None:
    """A CPU tensor (or a partial rotary table) runs Megatron's split and RoPE; extra arguments
    (another tensor format, interleaving) are refused rather than ignored."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 1, GROUPS, sum(SPLIT), generator=gen)
    freqs = _freqs(5, DIM)
    for got, want in zip(
        fused_qkv_rope.apply_fused_qkv_rope(qkv, freqs, freqs, SPLIT), _megatron(qkv, freqs), strict=True
    ):
        torch.testing.assert_close(got, want)
    assert not fused_qkv_rope._kernel_applies(qkv, freqs, freqs, SPLIT)
    assert not fused_qkv_rope._kernel_applies(qkv, _freqs(5, DIM // 2), _freqs(5, DIM // 2), SPLIT)
    with pytest.raises(NotImplementedError, match="sbhd"):
        fused_qkv_rope.apply_fused_qkv_rope(qkv, freqs, freqs, SPLIT, "thd")


def test_which_models_take_the_unsplit_path() -> None:
    """Plain RoPE models qualify; query/key norms (Qwen3) or interleaved RoPE do not. The config flag
    is set only where the hook is installed (a GPU), and set_fused_kernels switches it."""
    compat.init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_tiny_gpt()
    finally:
        compat.destroy_distributed()
    assert fused_qkv_rope.eligible(model)
    on_gpu = not compat.is_cpu()
    assert model.config.fused_single_qkv_rope == on_gpu
    set_fused_kernels(model, False)
    assert not model.config.fused_single_qkv_rope
    set_fused_kernels(model, True)
    assert model.config.fused_single_qkv_rope == on_gpu
    model.config.rotary_interleaved = True
    assert not fused_qkv_rope.eligible(model)
    model.config.rotary_interleaved = False
    model.decoder.layers[1].self_attention.q_layernorm = torch.nn.LayerNorm(DIM)
    assert not fused_qkv_rope.eligible(model)


def test_training_on_the_unsplit_path_equals_training_on_the_split(tmp_path: Path, monkeypatch) -> None:
    """The trainer's packed rows with and without Megatron's unsplit QKV path: the hook runs, and
    logprobs and LoRA gradients agree. On a GPU the kernels run (bf16: the same rounding, only the
    summation order may differ); on the CPU the hook is forced in and runs its split fallback (fp32:
    equal)."""
    from tests.unit.test_packed_rows import _train, slots_rank

    on_gpu = not compat.is_cpu()
    if on_gpu:
        assert compat.install_fused_qkv_rope()
    else:
        monkeypatch.setattr(attention, "HAVE_FUSED_QKV_ROPE", True)
        monkeypatch.setattr(
            attention, "apply_fused_qkv_rotary_pos_emb", fused_qkv_rope.apply_fused_qkv_rope, raising=False
        )
    calls = []
    real = attention.apply_fused_qkv_rotary_pos_emb
    monkeypatch.setattr(attention, "apply_fused_qkv_rotary_pos_emb", lambda *a: calls.append(1) or real(*a))
    rank = slots_rank(tmp_path, "bfloat16" if on_gpu else "float32")
    try:
        config = gpt_module(rank.model).config
        runs = {}
        for fused in (False, True):
            config.fused_single_qkv_rope = fused
            calls.clear()
            runs[fused] = _train(rank, True)
            assert bool(calls) == fused
    finally:
        compat.destroy_distributed()
    (lp, grads), (lp_f, grads_f) = runs[False], runs[True]
    diffs = [abs(a - b) for x, y in zip(lp, lp_f, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(diffs) < (1e-2 if on_gpu else 1e-6), max(diffs)
    for want, got in zip(grads, grads_f, strict=True):
        if on_gpu:
            cosine = torch.nn.functional.cosine_similarity(
                want.float().flatten(), got.float().flatten(), dim=0
            )
            assert cosine > 0.9999, cosine
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
