"""The per-sequence routing path (one slot per sequence: training rows, decode steps) equals the
per-token path and the independent PEFT references, forward and backward."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.lora import build_routing_plan
from miles_multilora.testing.lora import peft_reference, randomize_slots
from tests.helpers import assert_close_at_scale
from tests.unit.test_lora_layer import ALPHAS, RANKS, N, _make_layer, _run


def _per_sequence_ids(batch: int, seq: int) -> torch.Tensor:
    per_row = torch.tensor([3, -1, 0, 4, 0, 1])[:batch]  # unsorted, repeated, one base-only row
    return per_row.view(-1, 1).expand(batch, seq).contiguous()


def _forward_backward(layer, x, ids, per_sequence: bool, grad_out=None):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    layer.routing = build_routing_plan(ids, N, per_sequence=per_sequence)
    assert (layer.routing.seq_slots is not None) == per_sequence
    y, _ = _run(layer, x)
    grad_out = torch.randn_like(y, generator=None) if grad_out is None else grad_out
    (y * grad_out).sum().backward()
    return y.detach(), x.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone(), grad_out


@pytest.mark.parametrize("kind", ["plain", "column", "row"])
def test_per_sequence_path_equals_per_token_path_and_references(kind):
    layer = _make_layer(kind)
    randomize_slots(layer, RANKS, ALPHAS, seed=3)
    S, B = 5, 6
    ids = _per_sequence_ids(B, S)
    x = torch.randn(S, B, 12)
    fast = _forward_backward(layer, x, ids, per_sequence=True)
    slow = _forward_backward(layer, x, ids, per_sequence=False, grad_out=fast[4])
    for name, a, b in zip(("y", "dx", "dA", "dB"), fast[:4], slow[:4], strict=True):
        assert_close_at_scale(a, b, 1e-5, name)  # fp32: batched GEMMs vs per-token, other sum order

    def base(t):
        out = layer.base(t)
        return (out[0] + out[1] if out[1] is not None else out[0]) if isinstance(out, tuple) else out

    y_ref, _, _ = peft_reference(layer, base, x.clone().requires_grad_(True), ids, RANKS, ALPHAS)
    torch.testing.assert_close(fast[0], y_ref.detach(), rtol=1e-5, atol=1e-5)
    base_rows = ids[:, 0] == -1
    with torch.no_grad():
        plain = base(x)
    assert torch.equal(fast[0][:, base_rows], plain[:, base_rows]), "slot -1 rows are exactly the base model"
    unused = [s for s in range(N) if s not in set(ids[:, 0].tolist())]
    for s in unused:
        assert torch.count_nonzero(fast[2][s]) == 0 and torch.count_nonzero(fast[3][s]) == 0


def test_mixed_slots_within_a_sequence_use_the_per_token_path():
    ids = torch.tensor([[0, 0, 1], [2, 2, 2]])
    assert build_routing_plan(ids, 4).seq_slots is None
    assert build_routing_plan(ids[:, :2], 4).seq_slots.tolist() == [0, 2]


def test_batch_first_plain_layer_per_sequence_equals_per_token():
    from torch import nn

    from miles_multilora.lora import MultiLoRALinear

    torch.manual_seed(0)
    layer = MultiLoRALinear(nn.Linear(12, 10), N, 4, key="bf", batch_first=True)
    randomize_slots(layer, RANKS, ALPHAS, seed=4)
    B, S = 6, 5
    ids = _per_sequence_ids(B, S)
    x = torch.randn(B, S, 12)
    results = []
    for per_sequence in (True, False):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        layer.routing = build_routing_plan(ids, N, per_sequence=per_sequence)
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), xi.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
    for name, a, b in zip(("y", "dx", "dA", "dB"), *results, strict=True):
        assert_close_at_scale(a, b, 1e-5, name)  # fp32: batched GEMMs vs per-token, other sum order
