"""MultiLoRALinear equals N independent single-LoRA (PEFT formula) references, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles_multilora.errors import ConfigError
from miles_multilora.lora import MultiLoRALinear, build_routing_plan
from miles_multilora.testing.lora import megatron_tp1, peft_reference, randomize_slots, tiny_config
from tests.helpers import assert_close_at_scale

N, R = 6, 4
RANKS = [4, 2, 0, 3, 1, 4]  # slot 2 is empty (rank 0)
ALPHAS = [8.0, 3.0, 1.0, 7.0, 0.5, 16.0]


def _slot_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Random unsorted ids over -1..N-1 except slot 5, which gets no tokens (empty routed slot)."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([-1, 0, 1, 2, 3, 4])
    return choices[torch.randint(0, len(choices), (batch, seq), generator=gen)]


def _make_layer(kind: str) -> MultiLoRALinear:
    torch.manual_seed(0)
    if kind == "plain":
        base = nn.Linear(12, 10)
    else:
        megatron_tp1()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        cfg = tiny_config()
        init = nn.init.normal_
        if kind == "column":
            base = ColumnParallelLinear(12, 10, config=cfg, init_method=init, bias=True, gather_output=False)
        else:
            base = RowParallelLinear(
                12, 10, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=True
            )
        with torch.no_grad():
            base.bias.normal_()
    return MultiLoRALinear(base, N, R, key=f"test.{kind}")


def _run(layer: MultiLoRALinear, x: torch.Tensor):
    out = layer(x)
    if isinstance(out, tuple):
        y, bias = out
        return (y + bias if bias is not None else y), out
    return out, out


@pytest.mark.parametrize("kind", ["plain", "column", "row"])
def test_forward_and_grads_match_independent_references(kind):
    layer = _make_layer(kind)
    randomize_slots(layer, RANKS, ALPHAS, seed=1)
    S, B = 7, 5
    ids = _slot_ids(B, S, seed=2)
    layer.routing = build_routing_plan(ids, N)
    x = torch.randn(S, B, 12, requires_grad=True)
    y, raw = _run(layer, x)
    if kind != "plain":
        assert isinstance(raw, tuple) and len(raw) == 2  # Megatron's (output, bias) contract
    saved = layer.routing

    def base(t):
        out = layer.base(t)
        if isinstance(out, tuple):
            return out[0] + out[1] if out[1] is not None else out[0]
        return out

    y_ref, x_ref, params = peft_reference(layer, base, x, ids, RANKS, ALPHAS)
    # fp32: routed kernels vs PEFT's per-slot modules, other summation order
    assert_close_at_scale(y, y_ref, 1e-5, "y")
    grad_out = torch.randn_like(y)
    (y * grad_out).sum().backward()
    (y_ref * grad_out).sum().backward()
    assert_close_at_scale(x.grad, x_ref.grad, 1e-5, "dx")
    routed = set(ids.flatten().tolist()) - {-1}
    for s in range(N):
        r = RANKS[s]
        ga, gb = layer.lora_A.grad[s], layer.lora_B.grad[s]
        assert torch.count_nonzero(ga[r:]) == 0 and torch.count_nonzero(gb[:, r:]) == 0  # masked beyond rank
        if r and s in routed:
            assert_close_at_scale(ga[:r], params[s][0].grad, 1e-5, f"dA[{s}]")
            assert_close_at_scale(gb[:, :r], params[s][1].grad, 1e-5, f"dB[{s}]")
        else:
            assert torch.count_nonzero(ga) == 0 and torch.count_nonzero(gb) == 0
    assert saved is layer.routing
    for p in layer.base.parameters():
        assert not p.requires_grad and p.grad is None  # base frozen


def test_all_base_tokens_and_decode_shape():
    layer = _make_layer("plain")
    randomize_slots(layer, RANKS, ALPHAS)
    x = torch.randn(1, 3, 12)
    layer.routing = build_routing_plan(torch.full((3, 1), -1), N)  # decode step: [B, 1], all base
    torch.testing.assert_close(layer(x), layer.base(x))
    layer.routing = build_routing_plan(torch.tensor([[4], [-1], [0]]), N)
    y = layer(x)
    torch.testing.assert_close(y[0, 1], layer.base(x)[0, 1])
    expected = layer.base(x[0, 0]) + (ALPHAS[4] / RANKS[4]) * layer.lora_B[4] @ (layer.lora_A[4] @ x[0, 0])
    torch.testing.assert_close(y[0, 0], expected)


def test_batch_first_plain_linear_matches_sequence_first():
    layer = _make_layer("plain")
    randomize_slots(layer, RANKS, ALPHAS)
    ids = _slot_ids(3, 4, seed=5)
    x = torch.randn(4, 3, 12)
    layer.routing = build_routing_plan(ids, N)
    y_sf = layer(x)
    layer.batch_first = True
    y_bf = layer(x.transpose(0, 1).contiguous())
    torch.testing.assert_close(y_bf.transpose(0, 1), y_sf)


def test_scale_stays_fp32_after_bf16_cast():
    layer = _make_layer("plain")
    layer.set_slot_scale(0, 3, 1.0 / 3)
    layer.to(torch.bfloat16)
    assert layer.lora_scale.dtype == torch.float32
    assert layer.lora_scale[0].item() == torch.tensor(1.0 / 3, dtype=torch.float32).item()
    assert layer.lora_A.dtype == torch.bfloat16


def test_bad_routing_is_rejected_clearly():
    layer = _make_layer("plain")
    with pytest.raises(RuntimeError, match="set_token_slots"):
        layer(torch.randn(2, 2, 12))
    with pytest.raises(ConfigError, match="slot_ids"):
        build_routing_plan(torch.tensor([[0, N]]), N)
    with pytest.raises(ConfigError, match="slot_ids"):
        build_routing_plan(torch.tensor([[-2, 0]]), N)
    with pytest.raises(ConfigError, match="slot_ids"):
        build_routing_plan(torch.tensor([0, 1]), N)
    layer.routing = build_routing_plan(torch.zeros(2, 3, dtype=torch.long), N)
    with pytest.raises(ConfigError, match="slot_ids"):
        layer(torch.randn(5, 2, 12))
