"""The segmented matmul: CPU loop over non-empty segments, and the CUDA grouped-GEMM path."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.lora.kernels import grouped_mm_supported, segmented_matmul
from miles_multilora.lora.routing import build_routing_plan

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reference(x, weight, plan, grad_y):
    """Per-token gather reference in fp32: y_t = W[slot_t] x_t."""
    x = x.detach().float().requires_grad_(True)
    w = weight.detach().float().requires_grad_(True)
    y = torch.einsum("tmk,tk->tm", w[plan.sorted_slots], x)
    y.backward(grad_y.float())
    return y, x.grad, w.grad


def _case(counts: list[int], m: int, k: int, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((c,), s) for s, c in enumerate(counts)] + [torch.full((3,), -1)])
    ids = ids[torch.randperm(len(ids), generator=gen)].view(1, -1).to(device)
    plan = build_routing_plan(ids, len(counts))
    x = torch.randn(plan.num_routed, k, generator=gen).to(device, dtype).requires_grad_(True)
    w = torch.randn(len(counts), m, k, generator=gen).to(device, dtype).requires_grad_(True)
    grad_y = torch.randn(plan.num_routed, m, generator=gen).to(device, dtype)
    return plan, x, w, grad_y


def _check(plan, x, w, grad_y, tol):
    y = segmented_matmul(x, w, plan)
    y.backward(grad_y)
    y_ref, gx_ref, gw_ref = _reference(x, w, plan, grad_y)
    torch.testing.assert_close(y.float(), y_ref, **tol)
    torch.testing.assert_close(x.grad.float(), gx_ref, **tol)
    torch.testing.assert_close(w.grad.float(), gw_ref, **tol)
    for s, c in enumerate(plan.counts):
        if c == 0:
            assert torch.count_nonzero(w.grad[s]) == 0  # exactly zero for empty slots


@pytest.mark.parametrize("counts", [[5, 0, 7, 1, 0, 0, 3], [0, 0, 0, 4], [9]])
def test_cpu_segments_exact(counts):
    plan, x, w, gy = _case(counts, m=6, k=5, device="cpu", dtype=torch.float32)
    assert plan.counts == tuple(counts)
    _check(plan, x, w, gy, dict(rtol=1e-5, atol=1e-5))


def test_plan_orders_tokens_by_slot_and_skips_base_tokens():
    ids = torch.tensor([[2, -1, 0], [2, 1, -1]])  # [B=2, S=3]
    plan = build_routing_plan(ids, 4)
    flat = ids.t().reshape(-1)  # seq-first order
    assert plan.counts == (1, 1, 2, 0)
    assert flat[plan.order].tolist() == plan.sorted_slots.tolist() == [0, 1, 2, 2]
    assert plan.offsets.tolist() == [1, 2, 4, 4]
    assert plan.segments() == [(0, 0, 1), (1, 1, 2), (2, 2, 4)]
    bf = ids.reshape(-1)[plan.token_order(batch_first=True)]
    assert bf.tolist() == [0, 1, 2, 2]


@gpu
@needs_cuda
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("counts", [[5, 0, 17, 1, 0, 0, 300], [0, 0, 0, 33], [1] * 64, [0] * 63 + [1000]])
def test_grouped_gemm_matches_reference(rank, counts):
    plan, x, w, gy = _case(counts, m=rank, k=256, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_supported(x, w)
    _check(plan, x, w, gy, dict(rtol=2e-2, atol=2e-1))  # bf16 inputs, fp32 reference
    plan, h, wb, gy = _case(counts, m=256, k=rank, device="cuda", dtype=torch.bfloat16, seed=1)
    _check(plan, h, wb, gy, dict(rtol=2e-2, atol=2e-1))


@gpu
@needs_cuda
def test_cuda_forward_has_no_host_sync():
    plan, x, w, _ = _case([5, 0, 17, 1], m=16, k=128, device="cuda", dtype=torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        segmented_matmul(x, w, plan).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu
@needs_cuda
def test_cuda_bf16_layer_matches_cpu_fp32_layer():
    from torch import nn

    from miles_multilora.lora import MultiLoRALinear

    torch.manual_seed(0)
    cpu = MultiLoRALinear(nn.Linear(64, 48), num_slots=5, max_rank=16)
    with torch.no_grad():
        cpu.lora_A.normal_(0, 0.1)
        cpu.lora_B.normal_(0, 0.1)
        cpu.lora_B[3] = 0
    for s in range(5):
        cpu.set_slot_scale(s, 16, 2.0)
    gpu_layer = MultiLoRALinear(nn.Linear(64, 48), num_slots=5, max_rank=16).cuda().to(torch.bfloat16)
    gpu_layer.load_state_dict(cpu.state_dict())
    for s in range(5):
        gpu_layer.set_slot_scale(s, 16, 2.0)
    ids = torch.randint(-1, 4, (3, 37))  # slot 4 empty
    x = torch.randn(37, 3, 64)
    outs, grads = [], []
    for layer, dev, dtype in ((cpu, "cpu", torch.float32), (gpu_layer, "cuda", torch.bfloat16)):
        layer.routing = build_routing_plan(ids.to(dev), 5)
        xi = x.detach().to(dev, dtype).requires_grad_(True)
        y = layer(xi)
        y.float().square().sum().backward()
        outs.append(y.float().cpu())
        grads.append(
            [xi.grad.float().cpu(), layer.lora_A.grad.float().cpu(), layer.lora_B.grad.float().cpu()]
        )
    torch.testing.assert_close(outs[1], outs[0], rtol=3e-2, atol=3e-2)
    for g_gpu, g_cpu in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_gpu, g_cpu, rtol=5e-2, atol=5e-1 * g_cpu.abs().max().item() / 10)
    assert not grads[1][1][4].any() and not grads[1][2][4].any()
