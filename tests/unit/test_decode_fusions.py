"""The fused decode kernels equal the unfused module math: residual add + RMSNorm, SwiGLU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from miles_multilora.rollout.decode_fusions import HAVE_TRITON, add_rmsnorm, swiglu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_equals_add_then_the_norm_module(device, dtype):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 under the interpreter is slow; covered on GPU")
    gen = torch.Generator().manual_seed(0)
    hidden = 96  # not a power of 2: masked lanes
    norm = torch.nn.RMSNorm(hidden, eps=1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    residual = torch.randn(1, 7, hidden, generator=gen).to(device, dtype)
    delta = torch.randn(1, 7, hidden, generator=gen).to(device, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        new_residual, normed = add_rmsnorm(residual, delta, norm)
        torch.testing.assert_close(new_residual, residual + delta, rtol=0, atol=0)  # same rounding as the add
        torch.testing.assert_close(normed, norm(residual + delta), **tol)
        same, only_norm = add_rmsnorm(residual, None, norm)
        assert same is residual or torch.equal(same, residual)
        torch.testing.assert_close(only_norm, norm(residual), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_equals_megatrons_gated_linear_unit(device):
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(device)  # two column blocks
    a, b = torch.chunk(x, 2, dim=-1)
    torch.testing.assert_close(swiglu(x), F.silu(a) * b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swiglu(x.view(1, 5, -1)), (F.silu(a) * b).view(1, 5, -1), rtol=1e-5, atol=1e-5)
