"""Shared experts against real HF ``transformers`` + ``peft`` (a tiny random Qwen2-MoE, converted by our
megatron-bridge bridge): the base matches, a slot trained by our optimizer equals PEFT's LoRA on the
same model on held-out tokens (logits and the shared expert's LoRA gradients), and adapters
round-trip in PEFT's module names (``mlp.shared_expert.{gate,up,down}_proj``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.lora import apply_multi_lora, export_slot, init_slot, load_slot, multi_lora_layers
from miles_multilora.lora.expert_slots import canonical_name, hf_name
from miles_multilora.optim import SlotAdamW
from miles_multilora.testing.lora import lm_logits, mixed_train_step, per_row_lm_loss
from tests.moe_helpers import tiny_moe_hf_model

BATCH, SEQ = 2, 7
SHARED = ("gate_proj", "up_proj", "down_proj")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


HELD_OUT = _ids(999)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model

    hf = tiny_moe_hf_model("qwen2_moe")
    path = tmp_path_factory.mktemp("qwen2_moe")
    compat.init_distributed(tp=1, pp=1, seed=0)
    hf.save_pretrained(path)
    model = load_hf_model(path).model.eval()
    apply_multi_lora(model, "all-linear", num_slots=3, max_rank=6)
    return hf, model


def _logits(model, slot: int, ids: torch.Tensor = HELD_OUT) -> torch.Tensor:
    with torch.no_grad():
        return lm_logits(model, ids, torch.full(tuple(ids.shape), slot)).cpu()


def _shared_layers(model) -> list:
    return [la for la in multi_lora_layers(model) if ".shared_experts." in la.key]


def test_base_matches_hf_and_shared_experts_are_slot_layers(models):
    hf, model = models
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, -1), hf(HELD_OUT).logits, rtol=1e-5, atol=1e-5)
    keys = [layer.key for layer in _shared_layers(model)]
    assert keys == [f"layers.{i}.shared_experts.linear_{p}" for i in (0, 1) for p in ("fc1", "fc2")]


def test_trained_slot_equals_peft_lora_on_held_out_tokens(models, tmp_path):
    from peft import PeftModel

    hf, model = models
    opt = SlotAdamW(model)
    for slot, seed in ((0, 5), (1, 6)):
        init_slot(model, slot, rank=3, alpha=6.0, seed=seed)
        opt.configure_slot(slot, OptimizerSpec(lr=2e-2, clip_grad=0.0))
    model.train()
    for step in range(3):  # co-trained with slot 0; held-out tokens are never trained on
        mixed_train_step(model, opt, {0: _ids(10 + step), 1: _ids(20 + step)})
    model.eval()
    assert all(layer.lora_B[1].abs().sum() > 0 for layer in _shared_layers(model))
    export_slot(model, 1, tmp_path / "adapter", hf_config=hf.config)
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for leaf in SHARED:
        assert f"base_model.model.model.layers.1.mlp.shared_expert.{leaf}.lora_A.weight" in keys
    ours = _logits(model, 1)
    # our scoring and its gradients on the shared expert's LoRA (slot 1 only on these rows)
    model.zero_grad()
    per_row_lm_loss(lm_logits(model, HELD_OUT, torch.full((BATCH, SEQ), 1)), HELD_OUT).mean().backward()
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter"), is_trainable=True)
    try:
        theirs_logits = peft_model(HELD_OUT).logits
        per_row_lm_loss(theirs_logits, HELD_OUT).mean().backward()
        grads = {
            n: p.grad for n, p in peft_model.named_parameters() if ".shared_expert." in n and "lora_B" in n
        }
        theirs = theirs_logits.detach()
    finally:
        peft_model.unload()
        hf.zero_grad()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (ours - _logits(model, -1)).abs().max() > 1e-2  # the adapter matters
    rank = 3
    for layer in _shared_layers(model):
        i = int(layer.key.split(".")[1])
        ours_b = layer.lora_B.grad[1][:, :rank]
        base = f"base_model.model.model.layers.{i}.mlp.shared_expert"
        if layer.key.endswith("fc1"):
            theirs_b = torch.cat(
                [grads[f"{base}.{p}.lora_B.default.weight"] for p in ("gate_proj", "up_proj")]
            )
        else:
            theirs_b = grads[f"{base}.down_proj.lora_B.default.weight"]
        assert theirs_b.abs().max() > 0
        torch.testing.assert_close(ours_b, theirs_b, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    load_slot(model, 2, tmp_path / "adapter")  # and back exactly
    torch.testing.assert_close(_logits(model, 2), ours, rtol=0, atol=0)


def test_peft_made_adapter_with_shared_expert_loads_exactly(models, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    hf, model = models
    targets = ATTENTION + list(SHARED)  # the routed experts' and the shared expert's projections
    peft_model = get_peft_model(hf, LoraConfig(r=2, lora_alpha=5.0, target_modules=targets, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(tmp_path / "peft"))
    peft_model.unload()
    load_slot(model, 0, tmp_path / "peft")
    ranks = {layer.key: layer.slot_rank[0] for layer in _shared_layers(model)}
    assert ranks == {k: (4 if k.endswith("fc1") else 2) for k in ranks}  # gate/up: distinct A, stacked
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "peft"))
    try:
        with torch.no_grad():
            theirs = peft_model(HELD_OUT).logits
    finally:
        peft_model.unload()
    torch.testing.assert_close(_logits(model, 0), theirs, rtol=1e-5, atol=1e-5)
    # without its shared-expert modules the adapter gives other logits: the shared expert's LoRA counts
    weights = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".shared_expert." not in k}, str(tmp_path / "peft" / "w"))
    (tmp_path / "peft" / "w").replace(tmp_path / "peft" / "adapter_model.safetensors")
    load_slot(model, 1, tmp_path / "peft")
    assert (_logits(model, 1) - theirs).abs().max() > 1e-3


def test_deepseek_and_glm_names_for_the_shared_expert():
    name = "model.layers.3.mlp.shared_expert.gate_proj"
    for model_type in ("deepseek_v3", "glm4_moe"):
        theirs = hf_name(name, {"model_type": model_type})
        assert theirs == "model.layers.3.mlp.shared_experts.gate_proj"
        assert canonical_name(theirs) == name
    assert hf_name(name, {"model_type": "qwen2_moe"}) == name
    config = json.loads(json.dumps({"model_type": "mixtral"}))
    assert hf_name(name, config) == name
