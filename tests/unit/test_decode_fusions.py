"""The fused decode kernels equal the unfused module math: residual add + RMSNorm, SwiGLU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from miles_multilora.lora.row_delta import RowDelta
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
        wide = torch.cat([delta, torch.randn(1, 7, 5, generator=gen).to(device, dtype)], dim=-1)
        strided = add_rmsnorm(residual, wide[..., :hidden], norm)  # a stacked GEMM's output columns
        assert all(torch.equal(a, b) for a, b in zip(strided, (new_residual, normed), strict=True))
        same, only_norm = add_rmsnorm(residual, None, norm)
        assert same is residual or torch.equal(same, residual)
        torch.testing.assert_close(only_norm, norm(residual), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_equals_megatrons_gated_linear_unit(device):
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(device)  # two column blocks
    a, b = torch.chunk(x, 2, dim=-1)
    torch.testing.assert_close(swiglu(x), F.silu(a) * b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swiglu(x.view(1, 5, -1)), (F.silu(a) * b).view(1, 5, -1), rtol=1e-5, atol=1e-5)


def _lora_term(rows: int, width: int, device: str, gen: torch.Generator) -> RowDelta:
    """A deferred LoRA term: rows of slot -1 hold NaN (never written by the expand, never to be read)."""
    slots = torch.tensor([(-1 if r % 3 == 1 else r % 4) for r in range(rows)], device=device)
    delta = torch.randn(rows, width, generator=gen).to(device)
    delta[slots < 0] = float("nan")
    return RowDelta(delta, slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deferred_lora_term_is_added_as_the_in_place_expand_would(device, dtype):
    """add_rmsnorm and swiglu with a LoRA term equal adding it to their input (one rounding to the
    model dtype, rows of slot -1 untouched) and then the plain kernel, bit for bit."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 under the interpreter is slow; covered on GPU")
    gen = torch.Generator().manual_seed(2)
    rows, hidden = 7, 96
    norm = torch.nn.RMSNorm(hidden, eps=1e-6).to(device, dtype)
    residual = torch.randn(1, rows, hidden, generator=gen).to(device, dtype)
    out = torch.randn(1, rows, hidden, generator=gen).to(device, dtype)
    lora = _lora_term(rows, hidden, device, gen)
    with torch.no_grad():
        got = add_rmsnorm(residual, out, norm, lora)
        want = add_rmsnorm(residual, lora.add_to(out), norm)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    fc1 = torch.randn(rows, 2 * 1500, generator=gen).to(device, dtype)
    lora = _lora_term(rows, 2 * 1500, device, gen)
    assert torch.equal(swiglu(fc1, lora), swiglu(lora.add_to(fc1)))
    assert not torch.isnan(swiglu(fc1, lora)).any()
    with pytest.raises(ValueError, match="needs the output"):
        add_rmsnorm(residual, None, norm, lora)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dense", [False, True], ids=["split-k", "dense-shrink"])
@pytest.mark.parametrize("mix", ["mixed", "base-only"])
@pytest.mark.parametrize("programs", ["one-item-each", "few"])
def test_swiglu_runs_fc1s_lora_expand_as_the_in_place_expand_would(device, dense, mix, programs, monkeypatch):
    """fc1 leaves its shrink to the SwiGLU (a RowShrink): the result equals the layer's own forward
    (in-place expand) and then the plain SwiGLU, bit for bit, for any slot mix; more rows than one
    tile per slot, and the base-only rows (a segment of their own) pass through unchanged. With few
    programs, each walks several work items across tiles (reading each tile's shrink once)."""
    from torch import nn

    from miles_multilora.rollout import decode_fusions

    if programs == "few":
        monkeypatch.setattr(decode_fusions, "num_sms", lambda device: 1)  # 3 programs, 21 items
        monkeypatch.setattr(
            decode_fusions, "SWIGLU_EXPAND_CONFIG", dict(BLOCK_N=32, PROGRAMS_PER_SM=3, num_warps=4)
        )

    from miles_multilora.lora import MultiLoRALinear
    from miles_multilora.lora.row_delta import RowShrink
    from miles_multilora.lora.row_routing import build_row_routing, tile_sizes
    from miles_multilora.testing.lora import randomize_slots

    ranks, alphas = [4, 2, 0, 3], [8.0, 3.0, 1.0, 7.0]
    torch.manual_seed(3)
    fc1 = MultiLoRALinear(nn.Linear(24, 2 * 80, bias=False), 4, 4, key="fc1", kernels="triton").to(device)
    randomize_slots(fc1, ranks, alphas, seed=6)
    pattern = [0, -1, 3, 0, 1, 0, 2, 0, -1] if mix == "mixed" else [-1]
    slots = torch.tensor((pattern * 3)[:21], device=device)  # slot 0 spans two tiles of 16
    x = torch.randn(len(slots), 24, device=device)
    with torch.no_grad():
        fc1.routing = build_row_routing(slots, 4, tile_sizes(), all_rows=True)
        fc1.routing.dense_shrink = dense
        expected = swiglu(fc1(x))
        assert fc1.forward_deferred(x, consumer_expands=True)[2] is None  # the routing did not ask
        fc1.routing.expand_in_consumer = True
        out, bias, lora = fc1.forward_deferred(x, consumer_expands=True)
        assert isinstance(lora, RowShrink) and bias is None
        torch.testing.assert_close(out, fc1.base(x), rtol=0, atol=0)  # the base output alone
        got = swiglu(out, lora)
        assert torch.equal(lora.add_to(out), fc1(x))
    assert torch.equal(got, expected)
    if mix == "mixed":
        assert not torch.equal(got, swiglu(fc1.base(x)))
