"""Decode-step routing from a device tensor of row slots: the tile list covers every routed row
exactly once, and a layer routed this way equals the host-counted routing plan (Triton under the
CPU interpreter, and the PyTorch path), for any slot mix including base-only rows."""

from __future__ import annotations

import os

import pytest
import torch

from miles_multilora.lora import build_routing_plan
from miles_multilora.lora.row_routing import build_row_routing, tile_sizes
from miles_multilora.testing.lora import randomize_slots
from tests.unit.test_lora_layer import ALPHAS, RANKS, N, R, _make_layer, _run

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
MIXES = {
    "mixed": [3, -1, 0, 4, 0, 1, 3, 3, -1, 2, 4, 0, 1],
    "one-slot": [2] * 9,
    "base-only": [-1] * 5,
    "single-row": [4],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("block_m", [1, 2, 4, 16])
def test_tiles_cover_every_routed_row_once_in_slot_order(mix, block_m):
    slots = torch.tensor(MIXES[mix])
    routing = build_row_routing(slots, N, [block_m])
    tiles = routing.tiles[block_m]
    assert tiles.shape == (3, -(-len(slots) // block_m) + N)
    seen = []
    for slot, start, end in tiles.t().tolist():
        assert 0 <= end - start <= block_m
        for i in range(start, end):
            row = int(routing.order[i])
            assert int(slots[row]) == slot
            seen.append(row)
    assert sorted(seen) == [i for i, s in enumerate(MIXES[mix]) if s >= 0]


@pytest.mark.parametrize(
    "kernels",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="interpreter"))],
)
@pytest.mark.parametrize("kind", ["plain", "column", "row"])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("dense", [False, True], ids=["split-k", "dense-shrink"])
def test_row_routed_layer_equals_the_routing_plan(kind, mix, kernels, dense):
    if dense and kernels == "torch":
        pytest.skip("the dense shrink is a Triton-path schedule")
    layer = _make_layer(kind)
    randomize_slots(layer, RANKS, ALPHAS, seed=3)
    slots = torch.tensor(MIXES[mix])
    x = torch.randn(1, len(slots), 12) if kind != "plain" else torch.randn(len(slots), 12)
    with torch.no_grad():
        layer.routing = build_routing_plan(slots.view(-1, 1), N)
        expected, _ = _run(layer, x)
        layer.kernels = kernels
        layer.routing = build_row_routing(slots, N, tile_sizes())
        layer.routing.dense_shrink = dense
        got, _ = _run(layer, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_row_routing_replays_in_a_cuda_graph_with_new_slots_and_weights(device):
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    layer = _make_layer("column").cuda()
    randomize_slots(layer, RANKS, ALPHAS, seed=3)
    slots = torch.tensor(MIXES["mixed"], device="cuda")
    x = torch.randn(1, len(slots), 12, device="cuda")

    def step() -> torch.Tensor:
        layer.routing = build_row_routing(slots, N, tile_sizes())
        return _run(layer, x)[0]

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        slots.copy_(slots.flip(0))  # another adapter mix, same graph
        layer.lora_B.mul_(2.0)  # an optimizer step updates weights in place
        graph.replay()
        torch.testing.assert_close(out, step(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_the_split_k_decode_kernels_sum_their_partials(device):
    from torch import nn

    from miles_multilora.lora import MultiLoRALinear

    torch.manual_seed(0)
    layer = MultiLoRALinear(nn.Linear(600, 40), N, R, key="wide", kernels="triton").to(device)
    randomize_slots(layer, RANKS, ALPHAS, seed=4)  # K = 600: three K chunks of the decode shrink
    slots = torch.tensor(MIXES["mixed"], device=device)
    x = torch.randn(len(slots), 600, device=device)
    with torch.no_grad():
        layer.kernels = "torch"
        layer.routing = build_routing_plan(slots.view(-1, 1), N)
        expected = layer(x)
        layer.kernels = "triton"
        layer.routing = build_row_routing(slots, N, tile_sizes())
        got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True], ids=["split-k", "dense-shrink"])
def test_a_deferred_lora_term_completes_the_base_output(dense):
    """forward_deferred on a side stream: the base output plus its LoRA term (rows of slot -1
    skipped) equals the layer's own forward; without a side stream nothing is deferred."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layer = _make_layer("column").cuda()
    randomize_slots(layer, RANKS, ALPHAS, seed=5)
    slots = torch.tensor(MIXES["mixed"], device="cuda")
    x = torch.randn(1, len(slots), 12, device="cuda")
    with torch.no_grad():
        layer.routing = build_row_routing(slots, N, tile_sizes())
        layer.routing.dense_shrink = dense
        expected, _ = layer(x)
        out, bias, lora = layer.forward_deferred(x)
        assert lora is None and torch.equal(out, expected)  # no side stream: the usual forward
        layer.routing.side_stream = torch.cuda.Stream()
        out, bias, lora = layer.forward_deferred(x)
    assert lora is not None and bias is None
    assert not torch.allclose(out, expected)  # the base output alone
    torch.testing.assert_close(lora.add_to(out), expected, rtol=1e-5, atol=1e-5)
