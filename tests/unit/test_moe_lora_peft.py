"""Expert LoRA in PEFT's layout, against real HF ``transformers`` MoE models + ``peft`` (tiny random
Qwen3-MoE and Mixtral checkpoints converted by megatron-bridge): the base model matches, an exported
slot gives PEFT's logits and loads back exactly, and a PEFT-made expert adapter loads exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from miles_multilora.errors import SpecError
from miles_multilora.lora import apply_multi_lora, export_slot, init_slot, load_slot, multi_lora_layers
from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from miles_multilora.testing.lora import lm_logits
from tests.moe_helpers import randomize_b, tiny_moe_hf_model

BATCH, SEQ = 2, 7
EXPERT_MODULES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _megatron(hf, path, **lora):
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model

    compat.init_distributed(tp=1, pp=1, seed=0)
    hf.save_pretrained(path)
    model = load_hf_model(path).model.eval()
    apply_multi_lora(model, "all-linear", num_slots=3, max_rank=6, **lora)
    return model


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def arch_models(request, tmp_path_factory):
    hf = tiny_moe_hf_model(request.param)
    return request.param, hf, _megatron(hf, tmp_path_factory.mktemp(request.param))


def _peft_logits(hf, adapter_dir) -> torch.Tensor:
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir))
    try:
        with torch.no_grad():
            return peft_model(_ids()).logits
    finally:
        peft_model.unload()


def _logits(model, slot: int) -> torch.Tensor:
    with torch.no_grad():
        return lm_logits(model, _ids(), torch.full((BATCH, SEQ), slot)).cpu()


def test_exported_slot_gives_peft_logits_and_loads_back(arch_models, tmp_path):
    arch, hf, model = arch_models
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, -1), hf(_ids()).logits, rtol=1e-5, atol=1e-5)
    init_slot(model, 1, rank=3, alpha=7.0, seed=11)
    randomize_b(model, 1, seed=0, scale=0.2)
    export_slot(model, 1, tmp_path / "adapter", hf_config=hf.config)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(ATTENTION + list(EXPERT_MODULES[arch]))
    assert config["r"] == 3 and config["lora_alpha"] == 7.0 and not config["rank_pattern"]
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    experts = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for e in range(4):  # every expert's modules, one LoRA each (vLLM needs all three present)
        for leaf in EXPERT_MODULES[arch]:
            assert f"base_model.model.model.layers.1.{experts}.experts.{e}.{leaf}.lora_A.weight" in keys
    ours, base = _logits(model, 1), _logits(model, -1)
    theirs = _peft_logits(hf, tmp_path / "adapter")
    assert (theirs - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    load_slot(model, 2, tmp_path / "adapter")  # and back exactly (shared gate/up A: rank stays 3)
    assert {layer.slot_rank[2] for layer in multi_lora_layers(model)} == {3}
    torch.testing.assert_close(_logits(model, 2), ours, rtol=0, atol=0)


def _peft_made_adapter(hf, arch, out_dir, r: int, alpha: float) -> None:
    from peft import LoraConfig, get_peft_model

    targets = ATTENTION + list(EXPERT_MODULES[arch])
    peft_model = get_peft_model(
        hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(out_dir))
    peft_model.unload()


def test_peft_made_expert_adapter_loads_exactly(arch_models, tmp_path):
    arch, hf, model = arch_models
    _peft_made_adapter(hf, arch, tmp_path / "peft", r=2, alpha=5.0)
    load_slot(model, 0, tmp_path / "peft")
    ranks = {layer.key.split(".", 2)[-1]: layer.slot_rank[0] for layer in multi_lora_layers(model)}
    # fused qkv: 3 distinct A; the experts' gate/up: 2 distinct A per expert (stacked, like dense fc1)
    assert ranks == {"linear_qkv": 6, "linear_proj": 2, "experts.linear_fc1": 4, "experts.linear_fc2": 2}
    torch.testing.assert_close(_logits(model, 0), _peft_logits(hf, tmp_path / "peft"), rtol=1e-5, atol=1e-5)


def test_qwen3_moe_router_without_renormalised_top_k(tmp_path):
    """``norm_topk_prob=false``: the full softmax's top-k weights (Megatron's pre-softmax router)."""
    hf = tiny_moe_hf_model("qwen3_moe", norm_topk_prob=False)
    model = _megatron(hf, tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, -1), hf(_ids()).logits, rtol=1e-5, atol=1e-5)


def test_shared_expert_a_holds_shared_adapters_and_refuses_per_expert_ones(tmp_path):
    hf = tiny_moe_hf_model("qwen3_moe")
    model = _megatron(hf, tmp_path / "ckpt", shared_expert_a=True)
    fc1 = next(la for la in multi_lora_layers(model) if isinstance(la, MultiLoRAExpertLinear) and la.shared_a)
    assert fc1.lora_A.shape[:2] == (3, 1)
    init_slot(model, 0, rank=2, alpha=4.0, seed=1)
    randomize_b(model, 0, seed=2, scale=0.2)
    export_slot(model, 0, tmp_path / "shared", hf_config=hf.config)
    torch.testing.assert_close(_logits(model, 0), _peft_logits(hf, tmp_path / "shared"), rtol=1e-5, atol=1e-5)
    load_slot(model, 1, tmp_path / "shared")
    torch.testing.assert_close(_logits(model, 1), _logits(model, 0), rtol=0, atol=0)
    _peft_made_adapter(hf, "qwen3_moe", tmp_path / "peft", r=2, alpha=5.0)
    before = fc1.lora_A[2].clone()
    with pytest.raises(SpecError) as err:
        load_slot(model, 2, tmp_path / "peft")
    assert err.value.key == "lora.shared_expert_a"
    assert torch.equal(fc1.lora_A[2], before)
