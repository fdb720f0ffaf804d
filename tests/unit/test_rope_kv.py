"""The fused RoPE + KV-write decode kernel equals Megatron's RoPE followed by the cache write."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from miles_multilora.lora.row_delta import RowDelta
from miles_multilora.rollout.paged_attention import write_decode_kv
from miles_multilora.rollout.rope_kv import HAVE_TRITON, rope_and_write_kv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_lora", [False, True])
def test_fused_rope_and_kv_write_equal_the_unfused_path(device, with_lora):
    gen = torch.Generator().manual_seed(0)
    batch, groups, per_group, dim, page, pages, max_len = 5, 2, 3, 16, 8, 30, 40
    # Megatron's fused QKV output: per kv group its query heads, then k, then v
    qkv = torch.randn(batch, groups, per_group + 2, dim, generator=gen).to(device)
    lora = None
    if with_lora:
        slots = torch.tensor([0, -1, 2, 1, -1], device=device)
        delta = torch.randn(batch, groups * (per_group + 2) * dim, generator=gen).to(device)
        delta[slots < 0] = float("nan")  # rows of slot -1 are never written: must not be read
        lora = RowDelta(delta, slots)
    ref_qkv = lora.add_to(qkv.view(batch, -1)).view(qkv.shape) if lora is not None else qkv
    q = ref_qkv[:, :, :per_group].reshape(batch, groups * per_group, dim)
    k, v = ref_qkv[:, :, per_group], ref_qkv[:, :, per_group + 1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1).to(device)  # [max_len, dim], Megatron's layout
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    positions = torch.tensor([0, 7, 8, 15, 33], device=device)
    table = torch.randperm(pages - 1, generator=gen)[:25].add(1).view(batch, 5).int().to(device)
    kc, vc = (torch.randn(pages, page, groups, dim, generator=gen).to(device) for _ in range(2))
    ref_kc, ref_vc = kc.clone(), vc.clone()

    pos_freqs = freqs[positions].view(batch, 1, dim)
    ref_q = _apply_rotary_pos_emb_bshd(q, pos_freqs)
    ref_k = _apply_rotary_pos_emb_bshd(k, pos_freqs)
    write_decode_kv(ref_kc, ref_vc, ref_k, v, table, positions)
    got_q = rope_and_write_kv(qkv, cos, sin, positions, table, kc, vc, lora)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, ref_kc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, ref_vc, rtol=0, atol=0)
