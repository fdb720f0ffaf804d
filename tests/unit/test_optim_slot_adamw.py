"""SlotAdamW: per-slot AdamW math, schedules, clipping, veto, inactive slots, exact resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.lora import MultiLoRALinear
from miles_multilora.optim import SlotAdamW, learning_rate

N, R = 4, 3


def _layers(dtype=torch.float32) -> list[MultiLoRALinear]:
    torch.manual_seed(0)
    layers = [
        MultiLoRALinear(nn.Linear(5, 6), N, R, key="l0"),
        MultiLoRALinear(nn.Linear(6, 4), N, R, key="l1"),
    ]
    with torch.no_grad():
        for layer in layers:
            layer.lora_A.normal_()
            layer.lora_B.normal_()
            layer.to(dtype)
    return layers


def _params(layers):
    return [p for layer in layers for p in (layer.lora_A, layer.lora_B)]


def _set_grads(layers, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in _params(layers):
        p.grad = (scale * torch.randn(p.shape, generator=gen)).to(p.dtype)


def test_one_slot_matches_torch_adamw_with_clipping():
    layers = _layers()
    spec = OptimizerSpec(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, clip_grad=0.7)
    opt = SlotAdamW(layers)
    opt.configure_slot(2, spec)
    ref = [p[2].detach().clone().requires_grad_(True) for p in _params(layers)]
    ref_opt = torch.optim.AdamW(
        ref, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, weight_decay=spec.weight_decay
    )
    for step in range(4):
        _set_grads(layers, seed=step)
        for r, p in zip(ref, _params(layers), strict=True):
            r.grad = p.grad[2].clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, spec.clip_grad)
        ref_opt.step()
        stats = opt.step([2])
        assert stats[2].grad_norm == pytest.approx(norm.item(), rel=1e-6)
        assert stats[2].step == step + 1 and not stats[2].skipped
    for r, p in zip(ref, _params(layers), strict=True):
        torch.testing.assert_close(p[2], r.detach(), rtol=1e-6, atol=1e-6)


def test_only_active_slots_move_and_veto_is_per_slot():
    layers = _layers()
    opt = SlotAdamW(layers)
    for s in range(N):
        opt.configure_slot(s, OptimizerSpec(lr=0.1, weight_decay=0.5))
    before = [p.detach().clone() for p in _params(layers)]
    _set_grads(layers, seed=0)
    layers[1].lora_B.grad[1, 0, 0] = float("nan")
    stats = opt.step([1, 3])
    assert stats[1].skipped and not math.isfinite(stats[1].grad_norm) and stats[1].step == 0
    assert not stats[3].skipped and stats[3].step == 1
    assert opt.steps == [0, 0, 0, 1]
    for b, p, m in zip(before, _params(layers), opt.exp_avg, strict=True):
        for s in (0, 1, 2):  # inactive (0, 2) and vetoed (1): untouched weights and moments
            assert torch.equal(p[s], b[s]) and not m[s].any()
        assert not torch.equal(p[3], b[3]) and m[3].any()


def test_lr_schedules_per_slot():
    cos = OptimizerSpec(lr=1.0, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, total_steps=6)
    got = [learning_rate(cos, t) for t in range(7)]
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)] + [0.1]
    assert got == pytest.approx(expected)
    assert learning_rate(OptimizerSpec(lr=0.3, warmup_steps=3), 0) == pytest.approx(0.1)
    assert learning_rate(OptimizerSpec(lr=0.3), 100) == 0.3
    layers = _layers()
    opt = SlotAdamW(layers)
    opt.configure_slot(0, cos)
    opt.configure_slot(1, OptimizerSpec(lr=0.01))
    for _ in range(3):
        _set_grads(layers, 1)
        stats = opt.step([0, 1])
    assert stats[0].lr == pytest.approx(expected[2]) and stats[1].lr == 0.01
    assert opt.lr(0) == pytest.approx(expected[3])


def test_slot_state_dict_resumes_exactly():
    layers = _layers()
    opt = SlotAdamW(layers)
    spec = OptimizerSpec(lr=0.02, schedule="cosine", warmup_steps=1, total_steps=10, weight_decay=0.01)
    opt.configure_slot(1, spec)
    for step in range(3):
        _set_grads(layers, step)
        opt.step([1])
    saved_state = opt.slot_state_dict(1)
    saved_weights = [p[1].detach().clone() for p in _params(layers)]
    for step in range(3, 5):
        _set_grads(layers, step)
        opt.step([1])
    want = [p[1].detach().clone() for p in _params(layers)]

    resumed = _layers()
    with torch.no_grad():
        for p, w in zip(_params(resumed), saved_weights, strict=True):
            p[3] = w  # a different slot index on resume is fine
    opt2 = SlotAdamW(resumed)
    opt2.load_slot_state_dict(3, saved_state)
    assert opt2.steps[3] == 3 and opt2.specs[3] == spec
    for step in range(3, 5):
        _set_grads(resumed, step)
        for p in _params(resumed):
            p.grad[3] = p.grad[1].clone()
        opt2.step([3])
    for p, w in zip(_params(resumed), want, strict=True):
        assert torch.equal(p[3], w)


def test_bf16_params_keep_fp32_masters():
    layers32, layers16 = _layers(), _layers(torch.bfloat16)
    with torch.no_grad():
        for p32, p16 in zip(_params(layers32), _params(layers16), strict=True):
            p32.copy_(p16.float())
    opts = [SlotAdamW(layers32), SlotAdamW(layers16)]
    for o in opts:
        o.configure_slot(0, OptimizerSpec(lr=1e-3))
    for step in range(3):
        for layers, o in zip((layers32, layers16), opts, strict=True):
            _set_grads(layers, step)
            o.step([0])
    for p32, master, p16 in zip(_params(layers32), opts[1].master, _params(layers16), strict=True):
        torch.testing.assert_close(master[0], p32[0], rtol=1e-5, atol=1e-5)  # tiny updates survive in fp32
        assert torch.equal(p16[0], master[0].to(torch.bfloat16))


def test_bad_input_raises_and_changes_nothing():
    opt = SlotAdamW(_layers())
    with pytest.raises(SpecError, match="optimizer.lr"):
        opt.configure_slot(0, OptimizerSpec(lr=-1e-3))
    with pytest.raises(SpecError, match="optimizer.total_steps"):
        opt.configure_slot(0, OptimizerSpec(schedule="cosine"))
    with pytest.raises(SpecError, match="optimizer.schedule"):
        opt.configure_slot(0, OptimizerSpec(schedule="linear"))
    assert opt.specs[0] is None
    with pytest.raises(ConfigError, match="configure_slot"):
        opt.step([0])
    with pytest.raises(ConfigError, match="slot"):
        opt.configure_slot(N, OptimizerSpec())
    state = opt.slot_state_dict(0)
    state["exp_avg"]["l0.lora_A"] = torch.zeros(1)
    with pytest.raises(ConfigError, match="l0.lora_A"):
        opt.load_slot_state_dict(0, state)


def test_a_zero_learning_rate_moves_the_moments_not_the_weights():
    layers = _layers()
    opt = SlotAdamW(layers)
    opt.configure_slot(0, OptimizerSpec(lr=0.0, weight_decay=0.1))
    before = [p[0].detach().clone() for p in _params(layers)]
    _set_grads(layers, 0)
    opt.step([0])
    assert all(torch.equal(p[0], b) for p, b in zip(_params(layers), before, strict=True))
    assert any(float(m[0].abs().sum()) > 0 for m in opt.exp_avg)  # the step ran: its moments moved
