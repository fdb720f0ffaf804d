"""The fused SwiGLU of training equals the unfused gated unit, forward and backward, and the model's
MLPs use it on a GPU only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from miles_multilora.lora import apply_multi_lora, init_slot, token_slots
from miles_multilora.models import compat, provider
from miles_multilora.models.fused_mlp import FusedMLP, FusedSwiGLU
from miles_multilora.rollout.decode_fusions import HAVE_TRITON
from tests.helpers import assert_close_at_scale

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", autouse=True)
def _single_process_megatron():
    compat.init_distributed(tp=1, pp=1, seed=0)
    yield


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("device", DEVICES)
def test_fused_swiglu_equals_silu_times_gate_with_gradients(device):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 2 * 1100, generator=gen) * 3).to(device)  # F > one block: masked tail
    g = torch.randn(2, 5, 1100, generator=gen).to(device)
    x1 = x.clone().requires_grad_(True)
    y1 = FusedSwiGLU.apply(x1)
    y1.backward(g)
    x2 = x.clone().requires_grad_(True)
    a, b = torch.chunk(x2, 2, dim=-1)
    y2 = F.silu(a) * b
    y2.backward(g)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    assert_close_at_scale(x1.grad, x2.grad, 1e-5, "dx")  # fp32: fused vs PyTorch's elementwise ops


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU machine's models (Megatron puts buffers on the GPU)"
)
def test_models_build_fused_mlps_that_fall_back_on_cpu_tensors():
    model = provider.build_tiny_gpt(
        num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=40, seed=1
    ).cpu()
    assert {type(layer.mlp) for layer in model.decoder.layers} == {FusedMLP}
    assert all(layer.mlp.fusable == HAVE_TRITON for layer in model.decoder.layers)  # SiLU-gated, no bias
    ids = torch.randint(0, 40, (2, 6))
    positions = torch.arange(6).expand(2, -1)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, attention_mask=None)
        for layer in model.decoder.layers:
            layer.mlp.fused = False
        ref = model(input_ids=ids, position_ids=positions, attention_mask=None)
    assert torch.equal(out, ref)  # CPU activations: Megatron's own path both times


@pytest.mark.gpu
def test_fused_model_matches_megatron_modules_in_bf16_on_gpu():
    assert compat.install_fused_rope()
    model = provider.build_tiny_gpt(
        num_layers=2, hidden_size=256, ffn_hidden_size=688, num_attention_heads=4, num_query_groups=2,
        vocab_size=512, max_seq_len=128, seed=2, dtype="bfloat16",
    )  # fmt: skip
    apply_multi_lora(model, num_slots=2, max_rank=8)
    init_slot(model, 0, rank=8, alpha=16.0, seed=0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, 512, (3, 50), device="cuda")
    positions = torch.arange(50, device="cuda").expand(3, -1)
    results = []
    for fused in (True, False):
        provider.set_fused_kernels(model, fused)  # attention, SwiGLU and RoPE
        model.zero_grad(set_to_none=True)
        with token_slots(model, torch.zeros_like(ids)):
            logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
            logits.float().logsumexp(-1).mean().backward()
        grads = [p.grad.float().clone() for n, p in model.named_parameters() if "lora_A" in n]
        results.append((logits.float(), grads))
    (logits_f, grads_f), (logits_m, grads_m) = results
    assert (logits_f - logits_m).abs().max().item() < 0.1  # bf16 rounding of a different op order
    for a, b in zip(grads_f, grads_m, strict=True):
        assert (a - b).norm().item() <= 0.05 * b.norm().item() + 1e-6
