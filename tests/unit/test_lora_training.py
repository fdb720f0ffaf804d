"""Invariants on a tiny Megatron GPTModel: isolation, co-training equivalence, no leakage."""

from __future__ import annotations

import torch

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.lora import clear_slot, init_slot, multi_lora_layers
from miles_multilora.optim import SlotAdamW
from miles_multilora.testing.lora import lm_logits, mixed_train_step, per_row_lm_loss, tiny_gpt_with_lora
from tests.helpers import assert_close_at_scale

VOCAB, SEQ = 64, 8


def _data(adapter: int, step: int, rows: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * adapter + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=gen)


def _slot_grads(model, slot: int) -> list[torch.Tensor]:
    out = []
    for layer in multi_lora_layers(model):
        for p in (layer.lora_A, layer.lora_B):
            out.append(p.grad[slot].clone() if p.grad is not None else torch.zeros_like(p[slot]))
    return out


def _slot_weights(model, slot: int) -> list[torch.Tensor]:
    return [
        p[slot].detach().clone() for layer in multi_lora_layers(model) for p in (layer.lora_A, layer.lora_B)
    ]


def _make_b_nonzero(model, slot: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in multi_lora_layers(model):
            r = layer.slot_rank[slot]
            layer.lora_B[slot, :, :r] = 0.1 * torch.randn(layer.out_features, r, generator=gen)


def test_isolation_grads_of_a_slot_depend_only_on_its_tokens():
    model = tiny_gpt_with_lora(num_slots=3, max_rank=4)
    for s in range(3):
        init_slot(model, s, rank=4 - s, alpha=8.0, seed=s)
        _make_b_nonzero(model, s, seed=10 + s)

    def grads_of_slot0(ids, slots):
        for p in model.parameters():
            p.grad = None
        per_row_lm_loss(lm_logits(model, ids, slots), ids).sum().backward()
        return _slot_grads(model, 0)

    slots = torch.tensor([0, 1, -1, 0, 2])[:, None].expand(5, SEQ)
    ids = torch.randint(0, VOCAB, (5, SEQ))
    ref = grads_of_slot0(ids, slots)
    assert any(g.abs().sum() > 0 for g in ref)
    other = ids.clone()
    other[[1, 2, 4]] = torch.randint(0, VOCAB, (3, SEQ))  # change every row not routed to slot 0
    with torch.no_grad():
        for layer in multi_lora_layers(model):
            layer.lora_B[1].mul_(3.0)  # and another slot's weights
    for got, want in zip(grads_of_slot0(other, slots), ref, strict=True):
        assert torch.equal(got, want)
    changed = ids.clone()
    changed[3, 2] = (changed[3, 2] + 1) % VOCAB  # a token of slot 0 does change its grads
    assert any(not torch.equal(g, w) for g, w in zip(grads_of_slot0(changed, slots), ref, strict=True))


ADAPTERS = {  # slot: (rank, alpha, optimizer)
    0: (2, 4.0, OptimizerSpec(lr=3e-2, clip_grad=0.05)),
    1: (4, 8.0, OptimizerSpec(lr=1e-2, clip_grad=0.0, weight_decay=0.1)),
    2: (3, 6.0, OptimizerSpec(lr=2e-2, clip_grad=0.01, schedule="cosine", warmup_steps=2, total_steps=5)),
    3: (1, 2.0, OptimizerSpec(lr=5e-3, clip_grad=1.0, beta1=0.8)),
}


def _setup(model, slots, opt):
    for s in slots:
        rank, alpha, spec = ADAPTERS[s]
        init_slot(model, s, rank=rank, alpha=alpha, seed=100 + s)
        opt.configure_slot(s, spec)


def test_cotrained_adapter_equals_adapter_trained_alone():
    target = 2
    together = tiny_gpt_with_lora(num_slots=4, max_rank=4)
    opt_t = SlotAdamW(together)
    _setup(together, range(4), opt_t)
    alone = tiny_gpt_with_lora(num_slots=4, max_rank=4)
    opt_a = SlotAdamW(alone)
    _setup(alone, [target], opt_a)
    clipped = set()
    for step in range(5):
        stats = mixed_train_step(together, opt_t, {s: _data(s, step) for s in range(4)})
        clipped |= {s for s, st in stats.items() if st.grad_norm > ADAPTERS[s][2].clip_grad > 0}
        mixed_train_step(alone, opt_a, {target: _data(target, step)})
    assert {0, 2} <= clipped  # clipping was active on some adapters, the target included
    for got, want in zip(_slot_weights(together, target), _slot_weights(alone, target), strict=True):
        # fp32: only BLAS rounding differs. On a GPU the frozen base GEMMs see 4x more rows when
        # co-trained, and cuBLAS picks other kernels (other rounding) for other shapes: measured
        # 1.1e-6 on the H100 after 5 steps, so the bound there is 5e-6 (a leak would be ~1e-2).
        tol = 5e-6 if got.is_cuda else 1e-6
        assert ((got - want).norm() / want.norm()).item() <= tol
    assert opt_t.steps == [5, 5, 5, 5] and opt_a.steps == [0, 0, 5, 0]
    b_moved = _slot_weights(alone, target)[1]
    assert b_moved.abs().sum() > 0  # the adapter did train


def test_cleared_and_reused_slot_equals_a_fresh_slot():
    used = tiny_gpt_with_lora(num_slots=3, max_rank=4)
    opt_u = SlotAdamW(used)
    _setup(used, [0, 1], opt_u)
    for step in range(3):
        mixed_train_step(used, opt_u, {0: _data(0, step), 1: _data(1, step)})
    clear_slot(used, 1, optimizer=opt_u)
    init_slot(used, 1, rank=2, alpha=4.0, seed=7)
    opt_u.configure_slot(1, ADAPTERS[0][2])

    fresh = tiny_gpt_with_lora(num_slots=3, max_rank=4)
    opt_f = SlotAdamW(fresh)
    init_slot(fresh, 1, rank=2, alpha=4.0, seed=7)
    opt_f.configure_slot(1, ADAPTERS[0][2])

    for a, b in zip(
        _slot_weights(used, 1) + _slot_grads(used, 1),
        _slot_weights(fresh, 1) + _slot_grads(fresh, 1),
        strict=True,
    ):
        assert torch.equal(a, b)
    su, sf = opt_u.slot_state_dict(1), opt_f.slot_state_dict(1)
    assert su["step"] == sf["step"] == 0 and su["optimizer"] == sf["optimizer"]
    for part in ("exp_avg", "exp_avg_sq"):
        for name in su[part]:
            assert torch.equal(su[part][name], sf[part][name]) and not su[part][name].any()
    for layer_u, layer_f in zip(multi_lora_layers(used), multi_lora_layers(fresh), strict=True):
        assert layer_u.slot_rank[1] == layer_f.slot_rank[1] == 2
        assert layer_u.lora_scale[1] == layer_f.lora_scale[1]
    for step in range(2):  # and it trains exactly like the fresh one
        mixed_train_step(used, opt_u, {1: _data(5, step)})
        mixed_train_step(fresh, opt_f, {1: _data(5, step)})
    for a, b in zip(_slot_weights(used, 1), _slot_weights(fresh, 1), strict=True):
        assert_close_at_scale(a, b, 1e-6, "weights")  # fp32 BLAS rounding only; a leak moves them ~1e-2
