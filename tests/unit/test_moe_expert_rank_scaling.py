"""``lora.expert_rank_scaling``: a fresh adapter's routed experts get rank ``r / moe_router_topk`` at
the adapter's alpha, so their delta is exactly ``topk`` times that of the same ``A``/``B`` at rank
``r``'s scale; attention and the shared expert keep ``r``; off (the default) changes nothing."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.config.sections.lora import LoRAConfig
from miles_multilora.errors import SpecError
from miles_multilora.lora import init_slot, multi_lora_layers, token_slots
from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from tests.moe_helpers import tiny_moe_gpt

TOPK, RANK, ALPHA = 2, 4, 6.0
SHARED = dict(moe_shared_expert_ffn_hidden_size=16)


def _model(**kw):
    model = tiny_moe_gpt(num_slots=2, max_rank=RANK, **SHARED, **kw)
    init_slot(model, 0, rank=RANK, alpha=ALPHA, seed=3)
    return model


def _ranks_scales(model) -> dict[str, tuple[int, float]]:
    return {la.key: (la.slot_rank[0], la.slot_scale[0]) for la in multi_lora_layers(model)}


def _fc2_delta(model, x: torch.Tensor) -> torch.Tensor:
    """The first MoE layer's output minus its base output, the experts' fc2 LoRA only (linear in B)."""
    moe = model.decoder.layers[0].mlp
    with torch.no_grad(), token_slots(model, torch.zeros(x.shape[1], x.shape[0], dtype=torch.long)):
        lora = moe(x)[0]
    with torch.no_grad(), token_slots(model, torch.full((x.shape[1], x.shape[0]), -1)):
        base = moe(x)[0]
    return lora - base


def test_routed_experts_get_rank_over_topk_and_their_delta_scales_by_topk():
    on, off = _model(expert_rank_scaling=True), _model()
    r = RANK // TOPK
    for key, (rank, scale) in _ranks_scales(on).items():
        want = (r, ALPHA / r) if ".experts." in key else (RANK, ALPHA / RANK)
        assert (rank, scale) == want, key
    assert all(v == (RANK, ALPHA / RANK) for v in _ranks_scales(off).values())
    # the same A and B (rank r) in both: off's experts read them at scale alpha / RANK
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a, b in zip(multi_lora_layers(on), multi_lora_layers(off), strict=True):
            if isinstance(a, MultiLoRAExpertLinear):
                if a.proj == "linear_fc2":
                    a.lora_B[0, :, :, :r] = 0.3 * torch.randn(a.lora_B[0, :, :, :r].shape, generator=gen)
                b.lora_A[0].zero_()
                b.lora_B[0].zero_()
                b.lora_A[0, :, :r] = a.lora_A[0, :, :r]
                b.lora_B[0, :, :, :r] = a.lora_B[0, :, :, :r]
    x = torch.randn(5, 2, 32, generator=gen)
    delta_on, delta_off = _fc2_delta(on, x), _fc2_delta(off, x)
    assert delta_off.abs().max() > 1e-3
    torch.testing.assert_close(delta_on, TOPK * delta_off, rtol=1e-5, atol=1e-6)


def test_off_by_default_changes_nothing():
    assert LoRAConfig().expert_rank_scaling is False
    default, off = _model(), _model(expert_rank_scaling=False)
    assert _ranks_scales(default) == _ranks_scales(off)
    assert all(getattr(la, "rank_divisor", 1) == 1 for la in multi_lora_layers(default))
    for a, b in zip(multi_lora_layers(default), multi_lora_layers(off), strict=True):
        assert torch.equal(a.lora_A, b.lora_A) and torch.equal(a.lora_B, b.lora_B)


def test_a_rank_not_divisible_by_topk_is_refused_before_any_change():
    model = _model(expert_rank_scaling=True)
    before = _ranks_scales(model)
    with pytest.raises(SpecError) as err:
        init_slot(model, 0, rank=3, alpha=ALPHA, seed=1)
    assert err.value.key == "rank" and "multiple of 2" in str(err.value)
    assert _ranks_scales(model) == before


def test_registration_refuses_a_rank_the_scaled_experts_cannot_split():
    """The controller refuses the rank at registration, not when the adapter's slot is first set up."""
    from miles_multilora.config.run import config_from_container
    from miles_multilora.controller.admission import rules_for_run
    from miles_multilora.controller.core import ControllerCore

    tiny = {"num_experts": 4, "moe_router_topk": 2}
    on = config_from_container(
        {"model": {"source": "tiny", "tiny": tiny}, "lora": {"expert_rank_scaling": True}}
    )
    off = config_from_container({"model": {"source": "tiny", "tiny": tiny}})
    dense = config_from_container({"model": {"source": "tiny"}, "lora": {"expert_rank_scaling": True}})
    assert rules_for_run(on).expert_rank_multiple == 2
    assert rules_for_run(off).expert_rank_multiple == rules_for_run(dense).expert_rank_multiple == 1
    core = ControllerCore(num_slots=2, max_rank=16, rules=rules_for_run(on))
    spec = {"name": "odd", "dataset": {"task": "basic_arithmetic"}, "num_steps": 2, "rank": 3}
    with pytest.raises(SpecError) as info:
        core.register(spec)
    assert info.value.key == "rank" and "multiple of 2" in str(info.value)
    assert core.list() == []  # nothing registered
    assert core.register({**spec, "rank": 4})["state"] == "PENDING"
    assert core.register({**spec, "name": "attn_only", "lora_targets": ["attn"]})["state"] == "PENDING"
