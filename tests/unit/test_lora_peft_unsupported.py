"""Valid PEFT adapters with features a slot cannot hold are refused with the feature named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from miles_multilora.errors import SpecError
from miles_multilora.lora import load_slot, multi_lora_layers
from miles_multilora.testing.lora import tiny_gpt_with_lora

Q = "base_model.model.model.layers.0.self_attn.q_proj"
PLAIN = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_with_lora(num_slots=2, max_rank=4)


def _adapter(path, config: dict, extra: dict | None = None):
    path.mkdir()
    weights = {f"{Q}.lora_A.weight": torch.randn(2, 32), f"{Q}.lora_B.weight": torch.randn(32, 2)}
    save_file({**weights, **(extra or {})}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


CONFIG_CASES = {
    "use_dora": (True, "DoRA"),
    "lora_bias": (True, "LoRA bias"),
    "bias": ("all", "biases"),
    "fan_in_fan_out": (True, "fan_in_fan_out"),
    "modules_to_save": (["lm_head"], "modules_to_save"),
    "trainable_token_indices": ([1, 2], "trainable tokens"),
    "target_parameters": (["mlp.experts.gate_up_proj"], "target_parameters"),
    "alora_invocation_tokens": ([5, 6], "activated LoRA"),
    "use_qalora": (True, "QA-LoRA"),
    "layer_replication": ([[0, 2]], "layer_replication"),
    "use_bdlora": ({"nblocks": 2}, "block-diagonal"),
    "velora_config": ({"num_groups": 4}, "VeLoRA"),
    "monteclora_config": ({"n_samples": 2}, "MonteCLoRA"),
    "arrow_config": ({"top_k": 2}, "Arrow"),
    "kasa_config": ({"beta": 1.0}, "KaSA"),
    "init_lora_weights": ("pissa_niter_4", "plain LoRA"),
}


@pytest.mark.parametrize("key", sorted(CONFIG_CASES))
def test_unsupported_config_features_are_named(model, tmp_path, key):
    value, feature = CONFIG_CASES[key]
    with pytest.raises(SpecError, match="not supported") as err:
        load_slot(model, 0, _adapter(tmp_path / key, {**PLAIN, key: value}))
    assert err.value.key == key and feature in err.value.message


TENSOR_CASES = {
    f"{Q}.lora_magnitude_vector": (torch.ones(32), "DoRA"),
    "base_model.model.model.embed_tokens.lora_embedding_A": (torch.zeros(2, 64), "embedding LoRA"),
    f"{Q}.lora_B.bias": (torch.zeros(32), "LoRA bias"),
    "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": (
        torch.zeros(2, 32),
        "trainable",
    ),
    f"{Q}.lora_diag": (torch.ones(2), "KaSA"),
    f"{Q}.lora_velora_embed": (torch.ones(8), "VeLoRA"),
    f"{Q}.lora_E.weight": (torch.ones(2), "LoRA variant tensor"),
    "base_model.model.lm_head.weight": (torch.zeros(64, 32), "base-model tensor"),
    f"{Q}.bias": (torch.zeros(32), "base-model tensor"),
}


@pytest.mark.parametrize("name", sorted(TENSOR_CASES))
def test_unsupported_tensors_are_named(model, tmp_path, name):
    tensor, feature = TENSOR_CASES[name]
    with pytest.raises(SpecError, match="not supported") as err:
        load_slot(model, 0, _adapter(tmp_path / "a", PLAIN, {name: tensor}))
    assert err.value.key == name and feature in err.value.message


def test_other_refusals_and_nothing_changes(model, tmp_path):
    before = [layer.lora_A[1].clone() for layer in multi_lora_layers(model)]
    with pytest.raises(SpecError, match="not a PEFT LoRA weight name"):
        load_slot(model, 1, _adapter(tmp_path / "odd", PLAIN, {"something.else": torch.zeros(1)}))
    with pytest.raises(SpecError, match="not a PEFT LoRA weight name"):  # adapter name left in the key
        load_slot(
            model, 1, _adapter(tmp_path / "named", PLAIN, {f"{Q}.lora_A.default.weight": torch.zeros(1)})
        )
    with pytest.raises(SpecError, match="r=3") as err:  # weights of rank 2, config says 3
        load_slot(model, 1, _adapter(tmp_path / "rank", {**PLAIN, "rank_pattern": {"q_proj": 3}}))
    assert err.value.key == f"{Q}.lora_A.weight"
    with pytest.raises(SpecError, match="rank_pattern"):
        load_slot(model, 1, _adapter(tmp_path / "pattern", {**PLAIN, "rank_pattern": {"q_proj": 0}}))
    assert all(
        torch.equal(b, layer.lora_A[1]) for b, layer in zip(before, multi_lora_layers(model), strict=True)
    )
    load_slot(model, 1, _adapter(tmp_path / "fine", {**PLAIN, "init_lora_weights": "gaussian"}))
    assert {layer.slot_rank[1] for layer in multi_lora_layers(model)} == {0, 2}
