"""The Triton LoRA kernels (gather/scatter inside the GEMM) equal the PyTorch kernels and the
independent references, forward and backward, for any slot mix.

On a CPU machine they run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest);
on a GPU machine the ``cuda`` cases compile them, in fp32 and bf16.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from miles_multilora.errors import ConfigError
from miles_multilora.lora import MultiLoRALinear, apply_multi_lora, build_routing_plan, routed_ops
from miles_multilora.lora import triton_kernels as tk
from miles_multilora.lora.layer import check_kernels
from miles_multilora.lora.triton_kernels import HAVE_TRITON
from miles_multilora.testing.lora import randomize_slots
from tests.helpers import assert_close_at_scale
from tests.unit.test_lora_layer import ALPHAS, RANKS, N, R, _make_layer, _run, _slot_ids

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _pair(kind: str, device: str) -> tuple[MultiLoRALinear, MultiLoRALinear]:
    """The same layer twice: Triton kernels and PyTorch kernels, identical weights."""
    layers = []
    for kernels in ("triton", "torch"):
        layer = _make_layer(kind)
        layer.kernels = kernels
        randomize_slots(layer, RANKS, ALPHAS, seed=1)
        layers.append(layer.to(device))
    return layers[0], layers[1]


def _fwd_bwd(
    layer: MultiLoRALinear, x: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor | None = None
):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    layer.routing = build_routing_plan(ids.to(x.device), N)
    y, _ = _run(layer, x)
    if grad_out is None:
        grad_out = torch.randn_like(y)
    (y * grad_out).sum().backward()
    return [y.detach(), x.grad, layer.lora_A.grad, layer.lora_B.grad], grad_out


def _routings(batch: int, seq: int) -> dict[str, torch.Tensor]:
    per_seq = torch.tensor([3, -1, 0, 4, 0])[:batch].view(-1, 1).expand(batch, seq).contiguous()
    return {
        "per-token": _slot_ids(batch, seq, seed=2),
        "per-seq": per_seq,
        "one-slot": torch.full((batch, seq), 3),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["plain", "column", "row"])
@pytest.mark.parametrize("routing", ["per-token", "per-seq", "one-slot"])
def test_triton_layer_equals_torch_kernels(device, kind, routing, monkeypatch):
    fast, ref = _pair(kind, device)
    S, B = 7, 5
    ids = _routings(B, S)[routing]
    x = torch.randn(S, B, 12, device=device)
    one_op = []  # the base GEMM and the LoRA as one op (routed_ops.linear_with_lora)
    real = routed_ops.linear_with_lora
    monkeypatch.setattr(routed_ops, "linear_with_lora", lambda *a: one_op.append(1) or real(*a))
    got, grad_out = _fwd_bwd(fast, x, ids)
    assert one_op == [1]
    want, _ = _fwd_bwd(ref, x, ids, grad_out)
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, want, strict=True):
        # fp32 on CPU: the same terms, other sum order; the GPU's tl.dot rounds its inputs to tf32
        assert_close_at_scale(a, b, 1e-5 if device == "cpu" else 1e-3, name)
    unused = set(range(N)) - set(ids.flatten().tolist())
    for s in unused:  # slots without tokens get an exact zero gradient
        assert torch.count_nonzero(got[2][s]) == 0 and torch.count_nonzero(got[3][s]) == 0
    if (ids == -1).any():  # the LoRA adds exactly nothing to base-only tokens
        base_only = (ids == -1).t().to(device)
        with torch.no_grad():  # the one op's own base GEMM: on a GPU another shape may round otherwise
            out = fast._with_bias((x.reshape(-1, x.shape[-1]) @ fast.base.weight.t()).view(S, B, -1))
            plain = out[0] + out[1] if isinstance(out, tuple) and out[1] is not None else out
            plain = plain[0] if isinstance(plain, tuple) else plain
        assert torch.equal(got[0][base_only], plain[base_only])


@pytest.mark.parametrize("device", DEVICES)
def test_multi_chunk_weight_gradients_and_partial_tiles(device, monkeypatch):
    """Skewed slots: one slot spans several weight-gradient chunks (fp32 partials summed in order),
    others have a few tokens (partial tiles), one has none; batch-first plain input."""
    small = {"BLOCK_M": 16}
    monkeypatch.setattr(tk, "SHRINK_CONFIGS", {16: {**tk.SHRINK_CONFIGS[16], **small}})
    monkeypatch.setattr(
        tk, "EXPAND_CONFIGS", {16: {**tk.EXPAND_CONFIGS[16], **small, "BLOCK_N": 16, "SPLIT_N": 2}}
    )
    wgrad = {"BLOCK_T": 32, "MIN_CHUNK": 64, "CHUNKS_PER_SLOT": 64}
    monkeypatch.setattr(tk, "WGRAD_CONFIGS", {16: {**tk.WGRAD_CONFIGS[16], **wgrad}})
    torch.manual_seed(0)
    K, M, n = 136, 40, 5  # K is not a multiple of the kernel's K block
    base = nn.Linear(K, M, bias=False).to(device)
    layers = [
        MultiLoRALinear(base, n, R, key="skew", batch_first=True, kernels=k) for k in ("triton", "torch")
    ]
    with torch.no_grad():
        for layer in layers:
            torch.manual_seed(1)
            layer.lora_A.normal_()
            layer.lora_B.normal_()
            for s in range(n):
                layer.set_slot_scale(s, R, 0.5 * (s + 1))
    B, S = 3, 110
    ids = torch.full((B, S), 0)
    ids[1, :7] = 2
    ids[2, ::9] = 4
    ids[2, 1::9] = -1
    ids = ids[:, torch.randperm(S)]  # slot 1 and 3: no tokens; slot 0: ~280 tokens
    counts = torch.bincount(ids.flatten() + 1, minlength=n + 1)[1:]
    assert counts[0] > 4 * 64 and counts[1] == 0
    plan = build_routing_plan(ids.to(device), n)
    cfg = tk.launch_config(tk.WGRAD_CONFIGS, R)
    chunks, reductions, partials = routed_ops.weight_grad_schedule(plan, cfg, torch.device(device))
    assert reductions.shape[1] >= 1 and partials >= 4, "slot 0 must span several chunks"
    x = torch.randn(B, S, K, device=device)
    results = []
    grad_out = torch.randn(B, S, M, device=device)
    for layer in layers:
        layer.routing = plan
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * grad_out).sum().backward()
        results.append([y.detach(), xi.grad, layer.lora_A.grad, layer.lora_B.grad])
    for name, a, b in zip(("y", "dx", "dA", "dB"), *results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3, msg=lambda m, nm=name: f"{nm}: {m}")
    assert torch.count_nonzero(results[0][2][1]) == 0 and torch.count_nonzero(results[0][3][3]) == 0


@pytest.mark.gpu
def test_bf16_cuda_matches_fp32_reference():
    """Training sizes in bf16 on the GPU, against the PyTorch path in fp32 on the same weights."""
    torch.manual_seed(0)
    T, K, M, n, r = 4096, 1088, 512, 16, 16
    base = nn.Linear(K, M, bias=False, device="cuda", dtype=torch.bfloat16)
    fast = MultiLoRALinear(base, n, r, key="bf16", kernels="triton")
    with torch.no_grad():
        fast.lora_A.normal_(0, K**-0.5)
        fast.lora_B.normal_(0, r**-0.5)
    for s in range(n):
        fast.set_slot_scale(s, r, 2.0)
    ref = MultiLoRALinear(nn.Linear(K, M, bias=False, device="cuda"), n, r, key="fp32", kernels="torch")
    with torch.no_grad():
        ref.base.weight.copy_(base.weight.float())
        ref.lora_A.copy_(fast.lora_A.float())
        ref.lora_B.copy_(fast.lora_B.float())
    for s in range(n):
        ref.set_slot_scale(s, r, 2.0)
    ids = torch.randint(-1, n, (1, T), device="cuda")
    plan = build_routing_plan(ids, n)
    x = torch.randn(T, 1, K, device="cuda")
    g = torch.randn(T, 1, M, device="cuda")
    outs = []
    for layer, dtype in ((fast, torch.bfloat16), (ref, torch.float32)):
        layer.routing = plan
        xi = x.to(dtype).requires_grad_(True)
        y = layer(xi)
        y.backward(g.to(dtype))
        outs.append([t.float() for t in (y.detach(), xi.grad, layer.lora_A.grad, layer.lora_B.grad)])
    for name, a, b in zip(("y", "dx", "dA", "dB"), *outs, strict=True):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 1e-2, f"{name}: relative error {rel:.2e}"


def test_launcher_takes_tritons_launch_without_its_internals(monkeypatch):
    """A Triton without the 3.6 binder cache the direct launch reads: every launch goes through
    ``kernel[grid]`` (the same grid and arguments), and the launcher stops trying."""
    from miles_multilora.lora import triton_launch

    monkeypatch.setattr(triton_launch, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = []

    class Kernel:  # a JIT function of another Triton: no device_caches
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    class CudaArgument:
        is_cuda = True

    launcher = triton_launch.Launcher(Kernel())
    arg = CudaArgument()
    launcher((3,), arg, 7, num_warps=4)
    launcher((5, 2), arg, 8, num_warps=4)
    assert calls == [((3,), (arg, 7), {"num_warps": 4}), ((5, 2), (arg, 8), {"num_warps": 4})]
    assert not launcher._direct


@pytest.mark.gpu
def test_launcher_equals_triton_launch_bit_for_bit():
    """lora.triton_launch's direct launches give Triton's own launches' bits (forward, input and
    weight gradients with multi-chunk reductions, odd strides and sizes) and do reach its cache."""
    from miles_multilora.lora import triton_launch
    from miles_multilora.lora.routing import packed_routing_plan

    torch.manual_seed(0)
    n, r, K, M = 6, 16, 1032, 520  # sizes not multiples of 16: other specializations
    lengths = [2600, 7, 300, 1, 45]  # slot 0 spans several weight-gradient chunks
    plan = packed_routing_plan([0, 1, 2, 4, 2], lengths, n, "cuda")
    order = plan.token_order(False)
    dt = torch.bfloat16
    x0 = torch.randn(sum(lengths), K, device="cuda", dtype=dt)
    w = torch.randn(M, K, device="cuda", dtype=dt) / K**0.5
    a0 = torch.randn(n, r, K, device="cuda", dtype=dt) / K**0.5
    b0 = torch.randn(n, M, r, device="cuda", dtype=dt) / r**0.5
    scale = torch.linspace(0.5, 2.0, n, device="cuda")
    g = torch.randn(sum(lengths), M, device="cuda", dtype=dt)
    results = {}
    try:
        for enabled in (False, True, True):  # the second direct call runs from the cache
            triton_launch.ENABLED = enabled
            x, a, b = (t.clone().requires_grad_() for t in (x0, a0, b0))
            out = routed_ops.linear_with_lora(x, w, a, b, scale, plan, order)
            out.backward(g)
            results[enabled] = [out.detach(), x.grad, a.grad, b.grad]
    finally:
        triton_launch.ENABLED = True
    for name, ref, got in zip(("y", "dx", "dA", "dB"), results[False], results[True], strict=True):
        assert torch.equal(ref, got), name
    for launcher in (tk._launch_gather_shrink, tk._launch_scatter_expand,
                     tk._launch_segment_weight_grad, tk._launch_reduce_partials):  # fmt: skip
        assert launcher._compiled, launcher.kernel


def test_kernels_choice_is_validated():
    with pytest.raises(ConfigError, match="kernels"):
        check_kernels("cuda")
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="kernels"):
        apply_multi_lora(model, ["0"], kernels="fast")
    assert not any(isinstance(m, MultiLoRALinear) for m in model.modules()), "a bad choice changes nothing"
