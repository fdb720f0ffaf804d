"""Expert LoRA in one MoE layer equals a token-by-token plain-torch reference, forward and backward,
for both token dispatchers, both routing orders, a shared fc1 A, and the PyTorch and Triton kernels."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.errors import ConfigError
from miles_multilora.lora import init_slot, multi_lora_layers, token_slots
from miles_multilora.lora.expert_routing import EXPERT_MAJOR, SLOT_MAJOR, build_expert_plan
from tests.helpers import assert_close_at_scale
from tests.moe_helpers import randomize_b, reference_moe, tiny_moe_gpt

SLOTS, RANK = 3, 4
ROW_SLOTS = torch.tensor([0, 1, -1, 2, 0])  # one slot per sequence, a base-only row, slot 0 twice


def _model(**kw):
    model = tiny_moe_gpt(num_slots=SLOTS, max_rank=RANK, **kw)
    for s in range(SLOTS):
        init_slot(model, s, rank=RANK - s, alpha=8.0, seed=s)
        randomize_b(model, s, seed=10 + s, scale=0.3)
    return model


def _layer_io(model, seq: int = 6, seed: int = 1):
    moe = model.decoder.layers[0].mlp
    batch = ROW_SLOTS.numel()
    device = next(model.parameters()).device
    x = torch.randn(seq, batch, 32, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_()
    slots = ROW_SLOTS[:, None].expand(batch, seq).to(device)
    return moe, x, slots


def _rel(model) -> float:
    """fp32 rounding of the same sums in another order (more on a GPU: other GEMM kernels)."""
    return 1e-4 if next(model.parameters()).is_cuda else 1e-5


def _grads(moe, x):
    params = [p for layer in moe.experts.lora.values() for p in (layer.lora_A, layer.lora_B)]
    return [x.grad] + [p.grad for p in params]


def _zero(moe, x):
    x.grad = None
    for p in moe.parameters():
        p.grad = None


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("order", [SLOT_MAJOR, EXPERT_MAJOR])
@pytest.mark.parametrize("shared_a", [False, True], ids=["per-expert-A", "shared-A"])
def test_moe_layer_matches_token_by_token_reference(dispatcher, order, shared_a):
    model = _model(dispatcher=dispatcher, order=order, shared_expert_a=shared_a, kernels="torch")
    moe, x, slots = _layer_io(model)
    with token_slots(model, slots) as plan:
        out, bias = moe(x)
        assert bias is None
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
        (out * weights).sum().backward()
        got = [g.clone() for g in _grads(moe, x)]
        _zero(moe, x)
        flat_slots = torch.full_like(plan.order.new_empty(x.shape[0] * x.shape[1]), -1)
        flat_slots.index_copy_(0, plan.order, plan.sorted_slots)
    ref = reference_moe(moe, x.reshape(-1, 32), flat_slots).view_as(out)
    (ref * weights).sum().backward()
    assert_close_at_scale(out, ref, _rel(model) / 10, "output")
    for g, r, name in zip(got, _grads(moe, x), ["x", "fc1.A", "fc1.B", "fc2.A", "fc2.B"], strict=True):
        assert r.abs().max() > 0, name
        assert_close_at_scale(g, r, _rel(model), name)  # fp32: only the order of the sums differs


@pytest.mark.parametrize("shared_a", [False, True], ids=["per-expert-A", "shared-A"])
def test_triton_kernels_and_orders_give_the_torch_path(shared_a):
    """The Triton kernels (Triton's interpreter on a CPU) over (slot, expert) groups, in both orders."""
    results = []
    for kernels, order in (("torch", SLOT_MAJOR), ("triton", SLOT_MAJOR), ("triton", EXPERT_MAJOR)):
        model = _model(kernels=kernels, order=order, shared_expert_a=shared_a)
        moe, x, slots = _layer_io(model)
        with token_slots(model, slots):
            out, _ = moe(x)
            out.square().sum().backward()
        results.append([out.detach()] + [g.clone() for g in _grads(moe, x)])
    for other in results[1:]:
        for a, b in zip(other, results[0], strict=True):
            assert_close_at_scale(a, b, _rel(model))


def test_base_only_tokens_give_megatrons_moe_layer():
    """Slot -1 everywhere: the grouped base GEMMs and the dispatch with slots equal Megatron's own
    MoE layer (its SequentialMLP loop) on the same weights."""
    plain = tiny_moe_gpt(lora=False)
    reference = tiny_moe_gpt(lora=False)  # the same seed: the same weights
    moe = plain.decoder.layers[0].mlp
    ref_moe = reference.decoder.layers[0].mlp
    from miles_multilora.lora import apply_multi_lora

    apply_multi_lora(plain, "all-linear", num_slots=2, max_rank=2)
    device = next(plain.parameters()).device
    x = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(0)).to(device)
    with token_slots(plain, torch.full((3, 5), -1, device=device)):
        ours, _ = moe(x)
    theirs, _ = ref_moe(x)
    assert_close_at_scale(ours, theirs, _rel(plain) / 10)


def test_expert_plan_groups_rows_by_slot_and_expert():
    counts = [3, 0, 2]  # rows sorted by expert: e0 e0 e0 e2 e2
    row_slots = torch.tensor([1, -1, 0, 1, 1])
    by_slot = build_expert_plan(row_slots, counts, num_slots=2, order=SLOT_MAJOR)
    assert by_slot.groups.order.tolist() == [2, 0, 3, 4]  # (s0,e0) (s1,e0) (s1,e2) (s1,e2)
    assert by_slot.groups.sorted_slots.tolist() == [0, 3, 5, 5]  # g = s * 3 + e
    by_expert = build_expert_plan(row_slots, counts, num_slots=2, order=EXPERT_MAJOR)
    assert by_expert.groups.order.tolist() == [2, 0, 3, 4]  # (e0,s0) (e0,s1) (e2,s1) (e2,s1)
    assert [s for s, _, _ in by_expert.groups.segments()] == [0, 3, 5]
    assert by_expert.groups.counts == by_slot.groups.counts
    shared = build_expert_plan(row_slots, counts, num_slots=2, order=EXPERT_MAJOR, shared_a=True)
    rows_in_shared_order = shared.shared.order[shared.shared_to_groups]
    assert torch.equal(rows_in_shared_order, shared.groups.order)
    empty = build_expert_plan(torch.zeros(0, dtype=torch.long), [0, 0, 0], num_slots=2)
    assert empty.num_routed == 0 and empty.groups.counts == (0,) * 6


def test_many_slots_times_experts_have_no_group_cap():
    """64 slots x 17 experts = 1,088 weight groups (more than a 1,023-group grouped GEMM allows), in
    the Triton kernels' one pass (the benchmark runs 64 x 128)."""
    model = tiny_moe_gpt(num_slots=64, max_rank=2, num_experts=17, moe_router_topk=4, kernels="triton")
    layers = multi_lora_layers(model)
    for s in (0, 40, 63):
        init_slot(model, s, rank=2, alpha=4.0, seed=s)
        randomize_b(model, s, seed=s)
    moe, x, _ = _layer_io(model)
    slots = torch.tensor([0, 40, 63, -1, 40], device=x.device)[:, None].expand(5, x.shape[0])
    with token_slots(model, slots) as plan:
        out, _ = moe(x)
        out.sum().backward()
        flat_slots = torch.full_like(plan.order.new_empty(x.numel() // 32), -1)
        flat_slots.index_copy_(0, plan.order, plan.sorted_slots)
    expert_layers = [la for la in layers if la.key.startswith("layers.0.experts")]
    assert expert_layers[0].lora_A.shape[:2] == (64, 17)
    with torch.no_grad():
        ref = reference_moe(moe, x.reshape(-1, 32), flat_slots).view_as(out)
    assert_close_at_scale(out, ref, _rel(model))


@pytest.mark.parametrize(
    "setting",
    [
        {"moe_expert_capacity_factor": 1.0},
        {"moe_aux_loss_coeff": 1e-2, "moe_router_load_balancing_type": "aux_loss"},
        {"moe_z_loss_coeff": 1e-3},
        {"moe_input_jitter_eps": 1e-2},
    ],
    ids=["capacity", "aux-loss", "z-loss", "jitter"],
)
def test_settings_that_couple_adapters_are_refused_and_change_nothing(setting):
    model = tiny_moe_gpt(lora=False)
    for key, value in setting.items():
        setattr(model.config, key, value)
    for moe in (layer.mlp for layer in model.decoder.layers):
        moe.router.routing_type = model.config.moe_router_load_balancing_type  # read once at build
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    modules = [type(m) for m in model.modules()]
    from miles_multilora.lora import apply_multi_lora

    with pytest.raises(ConfigError) as err:
        apply_multi_lora(model, "all-linear", num_slots=2, max_rank=2)
    assert err.value.key.startswith("model.moe_")
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert [type(m) for m in model.modules()] == modules


def test_an_expert_rank_sent_no_rows_stays_in_the_graph_of_its_exchange():
    """No rows for any local expert (the tokens went to other EP ranks): the experts' output is still
    a function of the received rows, so the backward runs the token exchange that brought them, as
    the EP ranks with rows do (else they wait for this one forever)."""
    from miles_multilora.lora.expert_base import grouped_linear

    rows = torch.zeros(0, 4, requires_grad=True)
    out = grouped_linear(rows, torch.randn(2, 3, 4), [0, 0])
    assert out.shape == (0, 3) and out.grad_fn is not None
    out.sum().backward()
    assert rows.grad is not None and rows.grad.shape == (0, 4)
