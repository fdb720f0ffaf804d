"""Every slot's lora_A stacked under the base weight: one GEMM gives a decode step's base output and
its LoRA shrink, the base weight stays the trainer's (a view), and the stack follows lora_A."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from miles_multilora.lora import MultiLoRALinear
from miles_multilora.lora.row_delta import RowShrink
from miles_multilora.lora.row_routing import build_row_routing, tile_sizes
from miles_multilora.lora.stacked_shrink import stackable, sync_stacked, unstack
from miles_multilora.lora.triton_kernels import HAVE_TRITON
from miles_multilora.rollout.decode_fusions import swiglu
from miles_multilora.testing.lora import randomize_slots

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
SLOTS, RANK, IN, OUT = 4, 4, 24, 2 * 40  # 16 extra columns on 80: stackable


def _layer(device: str, bias: bool = False, out: int = OUT) -> MultiLoRALinear:
    torch.manual_seed(3)
    layer = MultiLoRALinear(nn.Linear(IN, out, bias=bias), SLOTS, RANK, key="fc1", kernels="triton").to(
        device
    )
    randomize_slots(layer, [4, 2, 0, 3], [8.0, 3.0, 1.0, 7.0], seed=6)
    return layer


def _slots(mix: str, device: str) -> torch.Tensor:
    pattern = [0, -1, 3, 0, 1, 0, 2, 0, -1] if mix == "mixed" else [-1]
    return torch.tensor((pattern * 21)[:21], device=device)  # slot 0 spans two tiles of 16


@pytest.mark.parametrize("device", DEVICES)
def test_the_stack_keeps_the_base_weight_and_follows_lora_a(device):
    layer = _layer(device)
    weight = layer.base.weight.detach().clone()
    keys = set(layer.state_dict())
    assert layer.stacked_weight is None
    assert sync_stacked([layer]) == 1
    stacked = layer.stacked_weight
    assert stacked.shape == (OUT + SLOTS * RANK, IN)
    assert layer.base.weight.data_ptr() == stacked.data_ptr()  # a view: no second copy
    assert torch.equal(layer.base.weight, weight) and isinstance(layer.base.weight, nn.Parameter)
    assert torch.equal(stacked[OUT:], layer.lora_A.detach().reshape(-1, IN))
    assert set(layer.state_dict()) == keys  # checkpoints do not see the stack
    with torch.no_grad():
        layer.lora_A.mul_(2.0)  # an optimizer step writes lora_A in place
    assert not torch.equal(stacked[OUT:], layer.lora_A.detach().reshape(-1, IN))
    sync_stacked([layer])
    assert layer.stacked_weight is stacked  # the same buffer: captured graphs stay valid
    assert torch.equal(stacked[OUT:], layer.lora_A.detach().reshape(-1, IN))
    layer.base.weight.data = layer.base.weight.data.clone()  # reallocated, as model.to would
    sync_stacked([layer])
    assert layer.stacked_weight is not stacked
    assert layer.base.weight.data_ptr() == layer.stacked_weight.data_ptr()
    assert torch.equal(layer.base.weight, weight)
    stacked = layer.stacked_weight
    assert unstack([layer]) == 1 and layer.stacked_weight is None
    assert layer.base.weight.data_ptr() != stacked.data_ptr() and torch.equal(layer.base.weight, weight)
    assert unstack([layer]) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", ["mixed", "base-only"])
def test_a_stacked_decode_step_equals_the_split_k_one(device, mix):
    """The expand in place into the stacked GEMM's strided output, and the SwiGLU that runs it from
    the stacked shrink (a RowShrink), give the split-K path's results within fp32 rounding."""
    layer = _layer(device)
    x = torch.randn(21, IN, device=device)
    slots = _slots(mix, device)
    with torch.no_grad():
        layer.routing = build_row_routing(slots, SLOTS, tile_sizes(), all_rows=True)
        expected = layer(x)  # split-K shrink, in-place expand
        sync_stacked([layer])
        layer.routing.stacked_shrink = True
        in_place, bias, lora = layer.forward_deferred(x)
        assert lora is None and bias is None
        assert in_place.stride(0) == OUT + SLOTS * RANK  # the base columns of the stacked GEMM
        torch.testing.assert_close(in_place, expected, rtol=1e-5, atol=1e-5)
        layer.routing.expand_in_consumer = True
        out, _, lora = layer.forward_deferred(x, consumer_expands=True)
        assert isinstance(lora, RowShrink) and lora.dense_scale is layer.lora_scale
        # the same GEMM and the expand's rounding: equal up to the GEMM's run-to-run determinism
        torch.testing.assert_close(swiglu(out, lora), swiglu(in_place), rtol=1e-6, atol=1e-6)
        layer.routing.expand_in_consumer = False
        layer.base.weight.data = layer.base.weight.data.clone()  # the stack no longer holds it
        stale, _, _ = layer.forward_deferred(x)
        assert stale.is_contiguous() and torch.equal(stale, expected)  # the split-K path ran
    if mix == "mixed":
        assert not torch.allclose(expected, layer.base(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_that_cannot_stack_keep_the_shrink_kernel(device):
    """A base bias, or slots whose A rows would widen the GEMM by more than a quarter, are not
    stacked; a stacked-shrink routing then runs the split-K path."""
    with_bias, narrow = _layer(device, bias=True), _layer(device, out=2 * SLOTS * RANK)
    assert not stackable(with_bias) and not stackable(narrow)
    assert sync_stacked([with_bias, narrow]) == 0
    assert with_bias.stacked_weight is None and narrow.stacked_weight is None
    x = torch.randn(21, IN, device=device)
    with torch.no_grad():
        narrow.routing = build_row_routing(_slots("mixed", device), SLOTS, tile_sizes())
        expected = narrow(x)
        narrow.routing.stacked_shrink = True
        out, _, lora = narrow.forward_deferred(x)
    assert lora is None and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
