"""PEFT interop against real HF ``transformers`` + ``peft`` on a tiny Llama (converted by the provider)."""

from __future__ import annotations

import json

import pytest
import torch

from miles_multilora.errors import SpecError
from miles_multilora.lora import apply_multi_lora, export_slot, init_slot, load_slot, multi_lora_layers
from miles_multilora.testing.lora import lm_logits
from tests.helpers import tiny_hf_model

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, SEQ = 2, 7


@pytest.fixture(scope="module")
def hf_and_megatron(tmp_path_factory):
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model

    compat.init_distributed(tp=1, pp=1, seed=0)
    hf = tiny_hf_model(
        "llama", seed=0, vocab_size=64, hidden_size=32, intermediate_size=48, max_position_embeddings=64
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(path)
    model = load_hf_model(path).model.eval()
    apply_multi_lora(model, "all-linear", num_slots=3, max_rank=6)
    return hf, model, path


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _peft_logits(hf, adapter_dir) -> torch.Tensor:
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir))
    try:
        with torch.no_grad():
            return peft_model(_ids()).logits
    finally:
        peft_model.unload()  # give the HF model back without LoRA layers


def test_exported_slot_gives_same_logits_in_peft(hf_and_megatron, tmp_path):
    hf, model, path = hf_and_megatron
    init_slot(model, 1, rank=3, alpha=7.0, seed=11)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in multi_lora_layers(model):
            layer.lora_B[1, :, :3] = 0.2 * torch.randn(layer.out_features, 3, generator=gen)
    export_slot(model, 1, tmp_path / "adapter", hf_config=hf.config)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (
        config["r"] == 3
        and config["lora_alpha"] == 7.0
        and sorted(config["target_modules"]) == sorted(HF_TARGETS)
    )
    slots = torch.full((BATCH, SEQ), 1)
    with torch.no_grad():
        ours = lm_logits(model, _ids(), slots)
        base = lm_logits(model, _ids(), torch.full((BATCH, SEQ), -1))
        torch.testing.assert_close(base, hf(_ids()).logits, rtol=1e-5, atol=1e-5)
    theirs = _peft_logits(hf, tmp_path / "adapter")
    assert (theirs - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    load_slot(model, 2, tmp_path / "adapter")  # and it loads back exactly (shared A: rank stays 3)
    assert {layer.slot_rank[2] for layer in multi_lora_layers(model)} == {3}
    with torch.no_grad():
        torch.testing.assert_close(
            lm_logits(model, _ids(), torch.full((BATCH, SEQ), 2)), ours, rtol=1e-6, atol=1e-6
        )


def _peft_made_adapter(hf, out_dir, r: int, alpha: float) -> None:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=HF_TARGETS, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(out_dir))
    peft_model.unload()


def test_peft_made_adapter_loads_into_a_slot_exactly(hf_and_megatron, tmp_path):
    hf, model, _ = hf_and_megatron
    _peft_made_adapter(hf, tmp_path / "peft", r=2, alpha=5.0)
    load_slot(model, 0, tmp_path / "peft")
    ranks = {layer.key.rsplit(".", 1)[-1]: layer.slot_rank[0] for layer in multi_lora_layers(model)}
    assert ranks == {"linear_qkv": 6, "linear_proj": 2, "linear_fc1": 4, "linear_fc2": 2}  # 3r / 2r blocks
    theirs = _peft_logits(hf, tmp_path / "peft")
    with torch.no_grad():
        ours = lm_logits(model, _ids(), torch.full((BATCH, SEQ), 0))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_peft_adapter_too_big_for_max_rank_is_refused(hf_and_megatron, tmp_path):
    hf, model, _ = hf_and_megatron
    _peft_made_adapter(hf, tmp_path / "big", r=3, alpha=6.0)  # fused qkv needs rank 9 > 6
    before = [layer.lora_A[2].clone() for layer in multi_lora_layers(model)]
    with pytest.raises(SpecError, match="max_rank") as err:
        load_slot(model, 2, tmp_path / "big")
    assert err.value.key == "rank"
    assert all(
        torch.equal(b, layer.lora_A[2]) for b, layer in zip(before, multi_lora_layers(model), strict=True)
    )
