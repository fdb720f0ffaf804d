"""The fused RoPE + KV-write decode kernel equals Megatron's RoPE followed by the cache write."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from miles_multilora.rollout.paged_attention import write_decode_kv
from miles_multilora.rollout.rope_kv import HAVE_TRITON, rope_and_write_kv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
def test_fused_rope_and_kv_write_equal_the_unfused_path(device):
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, page, pages, max_len = 5, 4, 2, 16, 8, 30, 40
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen).to(device)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided views
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1).to(device)  # [max_len, dim], Megatron's layout
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    positions = torch.tensor([0, 7, 8, 15, 33], device=device)
    table = torch.randperm(pages - 1, generator=gen)[:25].add(1).view(batch, 5).int().to(device)
    kc, vc = (torch.randn(pages, page, kv_heads, dim, generator=gen).to(device) for _ in range(2))
    ref_kc, ref_vc = kc.clone(), vc.clone()

    pos_freqs = freqs[positions].view(batch, 1, dim)
    ref_q = _apply_rotary_pos_emb_bshd(q, pos_freqs)
    ref_k = _apply_rotary_pos_emb_bshd(k, pos_freqs)
    write_decode_kv(ref_kc, ref_vc, ref_k, v, table, positions)
    got_q = rope_and_write_kv(q, k, v, cos, sin, positions, table, kc, vc)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, ref_kc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, ref_vc, rtol=0, atol=0)
