"""Slot lifecycle on a tiny GPTModel: deterministic init, strict load checks, clear, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.lora import clear_slot, export_slot, init_slot, load_slot, multi_lora_layers, slot_rank
from miles_multilora.testing.lora import tiny_gpt_with_lora


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_with_lora(num_slots=4, max_rank=4)


def _slot(model, slot):
    return [(layer.lora_A[slot].clone(), layer.lora_B[slot].clone()) for layer in multi_lora_layers(model)]


def test_init_is_deterministic_and_rank_masked(model):
    init_slot(model, 0, rank=3, alpha=6.0, seed=42)
    init_slot(model, 1, rank=3, alpha=6.0, seed=42)
    init_slot(model, 2, rank=3, alpha=6.0, seed=43)
    other = tiny_gpt_with_lora(num_slots=2, max_rank=4)
    init_slot(other, 1, rank=3, alpha=6.0, seed=42)
    for (a0, b0), (a1, _), (a2, _), (ao, bo) in zip(
        _slot(model, 0), _slot(model, 1), _slot(model, 2), _slot(other, 1), strict=True
    ):
        assert torch.equal(a0, a1) and torch.equal(a0, ao)  # same seed -> same A, any slot, any model
        assert not torch.equal(a0, a2)
        assert a0[:3].abs().sum() > 0 and not a0[3:].any()  # zero beyond the rank
        assert not b0.any() and not bo.any()
    layer = multi_lora_layers(model)[0]
    assert layer.slot_rank[0] == 3 and layer.lora_scale[0].item() == pytest.approx(2.0)
    assert slot_rank(model, 0) == 3


def test_bad_init_changes_nothing(model):
    init_slot(model, 3, rank=2, alpha=4.0, seed=1)
    before = _slot(model, 3)
    with pytest.raises(SpecError) as err:
        init_slot(model, 3, rank=5, alpha=4.0, seed=2)
    assert err.value.key == "rank"
    with pytest.raises(SpecError, match="alpha"):
        init_slot(model, 3, rank=2, alpha=0.0, seed=2)
    with pytest.raises(ConfigError, match="slot"):
        init_slot(model, 4, rank=2, alpha=4.0, seed=2)
    for (a, b), (a2, b2) in zip(before, _slot(model, 3), strict=True):
        assert torch.equal(a, a2) and torch.equal(b, b2)


def test_clear_slot_erases_weights_grads_and_scale(model):
    init_slot(model, 2, rank=4, alpha=8.0, seed=3)
    for layer in multi_lora_layers(model):
        layer.lora_A.grad = torch.ones_like(layer.lora_A)
    clear_slot(model, 2)
    for layer in multi_lora_layers(model):
        assert not layer.lora_A[2].any() and not layer.lora_B[2].any() and not layer.lora_A.grad[2].any()
        assert layer.lora_A.grad[1].all()  # other slots untouched
        assert layer.slot_rank[2] == 0 and layer.lora_scale[2] == 0
        layer.lora_A.grad = None
    with pytest.raises(ConfigError, match="empty"):
        export_slot(model, 2, "/nonexistent")


def _exported(model, tmp_path):
    init_slot(model, 1, rank=2, alpha=3.0, seed=9)
    return export_slot(model, 1, tmp_path / "a")


def test_export_is_sliced_to_rank_and_load_round_trips(model, tmp_path):
    path = _exported(model, tmp_path)
    weights = load_file(str(path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in weights
    assert all(t.shape[0] == 2 for k, t in weights.items() if "lora_A" in k)
    assert all(t.shape[1] == 2 for k, t in weights.items() if "lora_B" in k)
    assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (32, 2)
    assert weights["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (16, 2)
    assert weights["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (64, 2)
    load_slot(model, 0, path)
    for (a0, b0), (a1, b1) in zip(_slot(model, 0), _slot(model, 1), strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)


def test_load_is_strict_and_changes_nothing(model, tmp_path):
    path = _exported(model, tmp_path)
    init_slot(model, 3, rank=1, alpha=1.0, seed=0)
    before = _slot(model, 3)
    weights = load_file(str(path / "adapter_model.safetensors"))
    bad_key = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    bad = dict(weights, **{bad_key: torch.zeros(2, 32)})
    save_file(bad, str(tmp_path / "bad_key.safetensors"))
    cases = {}
    cases["unknown module"] = (bad, bad_key)
    shape_key = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    cases["bad shape"] = (dict(weights, **{shape_key: torch.zeros(31, 2)}), shape_key)
    pair_key = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    cases["missing pair"] = ({k: v for k, v in weights.items() if k != pair_key}, pair_key)
    for name, (tensors, key) in cases.items():
        case_dir = tmp_path / name.replace(" ", "_")
        case_dir.mkdir()
        save_file(tensors, str(case_dir / "adapter_model.safetensors"))
        (case_dir / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
        with pytest.raises(SpecError) as err:
            load_slot(model, 3, case_dir)
        assert err.value.key == key, name
    config = json.loads((path / "adapter_config.json").read_text())
    config["use_dora"] = True
    (tmp_path / "missing_pair" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match="use_dora"):
        load_slot(model, 3, tmp_path / "missing_pair")
    with pytest.raises(SpecError, match="not a PEFT adapter"):
        load_slot(model, 3, tmp_path / "nowhere")
    for (a, b), (a2, b2) in zip(before, _slot(model, 3), strict=True):
        assert torch.equal(a, a2) and torch.equal(b, b2)
