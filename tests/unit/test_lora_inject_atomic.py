"""apply_multi_lora checks every target before it changes the model: a refused call leaves it as it was."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.errors import ConfigError
from miles_multilora.lora import MultiLoRALinear, apply_multi_lora


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """A tiny Megatron model from an HF Llama with tied embeddings (output_layer has no own weight)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model

    compat.init_distributed(tp=1, pp=1, seed=0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tied_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return load_hf_model(path).model


def _state(model: torch.nn.Module) -> tuple[list, list]:
    modules = [(name, type(m)) for name, m in model.named_modules()]
    flags = [(name, p.requires_grad) for name, p in model.named_parameters()]
    return modules, flags


@pytest.mark.parametrize(
    ("targets", "match"),
    [
        (["linear_qkv", "output_layer"], "tied embeddings"),
        (["linear_qkv", "linear_fc3"], "unknown"),
        ("all-linears", "all-linear"),
    ],
)
def test_refused_targets_leave_the_model_untouched(tied_model, targets, match):
    before = _state(tied_model)
    assert any(flag for _, flag in before[1])  # a fresh model: something to freeze
    with pytest.raises(ConfigError, match=match) as err:
        apply_multi_lora(tied_model, targets, num_slots=2, max_rank=4)
    assert err.value.key == "target_modules"
    assert _state(tied_model) == before


def test_corrected_retry_works(tied_model):
    with pytest.raises(ConfigError):
        apply_multi_lora(tied_model, ["linear_qkv", "output_layer"], num_slots=2, max_rank=4)
    layers = apply_multi_lora(tied_model, ["linear_qkv"], num_slots=2, max_rank=4)
    assert [layer.key for layer in layers] == ["layers.0.linear_qkv", "layers.1.linear_qkv"]
    assert sum(isinstance(m, MultiLoRALinear) for m in tied_model.modules()) == 2
    trainable = {name for name, p in tied_model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"decoder.layers.{i}.self_attention.linear_qkv.lora_{w}" for i in (0, 1) for w in "AB"
    }
