"""The fused RoPE kernel equals Megatron's unfused RoPE, forward and backward."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from miles_multilora.models import compat
from miles_multilora.models.fused_rope import HAVE_TRITON, _FusedRoPE, applies
from tests.helpers import assert_close_at_scale

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def _freqs(seq: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.outer(torch.arange(seq).float(), inv)
    return torch.cat([f, f], dim=-1).view(seq, 1, 1, dim)  # Megatron's non-interleaved layout


@pytest.mark.parametrize("device", DEVICES)
def test_fused_rope_equals_megatron_rope_with_gradients(device):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 3, 5, 3 * 16, generator=gen).to(device)  # q is a strided view, as in Megatron
    freqs = _freqs(9, 16).to(device)[:7]
    g = torch.randn(7, 3, 5, 16, generator=gen).to(device)
    results = []
    for fused in (True, False):
        x = qkv.clone().requires_grad_(True)
        t = x[..., 16:32]
        if fused:
            y = _FusedRoPE.apply(t, freqs.reshape(7, -1))
        else:
            y = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
        y.backward(g)
        results.append((y.detach(), x.grad))
    (y_f, grad_f), (y_m, grad_m) = results
    torch.testing.assert_close(y_f, y_m, rtol=1e-5, atol=1e-5)
    assert_close_at_scale(grad_f, grad_m, 1e-5, "grad")  # fp32: kernel vs Megatron's rotation
    assert grad_f[..., :16].abs().max() == 0 and grad_f[..., 32:].abs().max() == 0


def test_only_whole_head_non_interleaved_batch_shared_rope_is_fused():
    t = torch.zeros(4, 2, 3, 16, device="cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = t.is_cuda
    assert applies(t, _freqs(4, 16).to(t.device), interleaved=False) == on_gpu
    assert not applies(t, _freqs(4, 16).to(t.device), interleaved=True)
    assert not applies(t, _freqs(4, 8).to(t.device), interleaved=False)  # partial rotary
    assert not applies(t, _freqs(4, 16).to(t.device).expand(4, 2, 1, 16), interleaved=False)  # per-row


def test_the_rope_hook_is_filled_on_gpu_only():
    assert compat.install_fused_rope() == (not compat.is_cpu())
