"""The model provider: HF checkpoints through megatron-bridge match HF transformers exactly."""

from __future__ import annotations

import json

import pytest
import torch

from miles_multilora.errors import ConfigError
from miles_multilora.models import compat, provider
from tests.helpers import hf_state_dict, make_tiny_hf_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _single_process_megatron():
    compat.init_distributed(tp=1, pp=1, seed=0)
    yield


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits, hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_checkpoint_gives_same_logits_and_exports_exactly(tmp_path, arch):
    path = make_tiny_hf_checkpoint(tmp_path / arch, arch=arch, seed=3)
    loaded = provider.load_hf_model(path)
    ids = torch.randint(0, loaded.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = loaded.model.eval()(input_ids=ids, position_ids=positions, attention_mask=None)
    ref, hf = _hf_logits(path, ids)
    assert ours.shape[:2] == ref.shape[:2]
    assert (ours[..., : loaded.vocab_size] - ref).abs().max().item() <= 1e-5

    exported = hf_state_dict(loaded)
    reference = hf.state_dict()
    assert set(exported) == set(reference)
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name


def test_tiny_config_builds_a_trainable_model():
    model = provider.build_tiny_gpt(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=50,
        max_seq_len=64,
    )
    ids = torch.randint(0, 50, (3, 7))
    logits = model(input_ids=ids, position_ids=torch.arange(7).expand(3, -1), attention_mask=None)
    assert logits.shape == (3, 7, 50)
    logits.sum().backward()
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad is not None


def test_missing_checkpoint_dir_names_the_path(tmp_path):
    with pytest.raises(ConfigError) as err:
        provider.load_hf_model(tmp_path / "nope")
    assert err.value.key == "model.hf_path" and "nope" in str(err.value)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match="unsupported architecture.*BertForMaskedLM"):
        provider.load_hf_model(tmp_path)
