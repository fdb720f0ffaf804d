"""An imported PEFT adapter exports back with its own shape: modules, layers, per-module rank/alpha, rsLoRA."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load_file

from miles_multilora.lora import (
    apply_multi_lora,
    export_slot,
    init_slot,
    load_slot,
    load_slot_state,
    multi_lora_layers,
    slot_state,
)
from miles_multilora.lora.peft_format import peft_form
from miles_multilora.testing.lora import lm_logits
from tests.helpers import tiny_hf_model

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB, BATCH, SEQ = 64, 2, 7


@pytest.fixture(scope="module")
def hf_and_megatron(tmp_path_factory):
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model

    compat.init_distributed(tp=1, pp=1, seed=0)
    hf = tiny_hf_model(
        "llama",
        seed=0,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny_llama3")
    hf.save_pretrained(path)
    model = load_hf_model(path).model.eval()
    apply_multi_lora(model, "all-linear", num_slots=2, max_rank=16)
    return hf, model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _peft_adapter(hf, out_dir, **config) -> None:
    """A PEFT-made adapter with random non-zero B (A keeps PEFT's own init)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf, LoraConfig(lora_dropout=0.0, **config))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(out_dir))
    peft_model.unload()


def _in_peft(hf, adapter_dir) -> tuple[dict, torch.Tensor]:
    """What PEFT makes of an adapter dir: {module: (r, alpha, scaling)} of its LoRA layers, and logits."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir))
    try:
        modules = {
            name.removeprefix("base_model.model."): (
                m.r["default"],
                m.lora_alpha["default"],
                m.scaling["default"],
            )
            for name, m in peft_model.named_modules()
            if isinstance(m, LoraLayer)
        }
        with torch.no_grad():
            return modules, peft_model(_ids()).logits
    finally:
        peft_model.unload()


def _config(adapter_dir) -> dict:
    return json.loads((adapter_dir / "adapter_config.json").read_text())


def _assert_same_adapter(hf, original, exported) -> None:
    w_orig, w_exp = (
        load_file(str(original / "adapter_model.safetensors")),
        load_file(str(exported / "adapter_model.safetensors")),
    )
    assert sorted(w_exp) == sorted(w_orig)
    for key, t in w_orig.items():
        assert w_exp[key].shape == t.shape, key
        torch.testing.assert_close(w_exp[key], t, rtol=1e-6, atol=1e-7, msg=key)
    assert bool(_config(exported)["use_rslora"]) == bool(_config(original)["use_rslora"])
    mods_orig, logits_orig = _in_peft(hf, original)
    mods_exp, logits_exp = _in_peft(hf, exported)
    assert mods_exp.keys() == mods_orig.keys()
    for name, (r, alpha, scaling) in mods_orig.items():
        assert mods_exp[name][0] == r and mods_exp[name][1] == pytest.approx(alpha), name
        assert mods_exp[name][2] == pytest.approx(scaling, rel=1e-12), name
    torch.testing.assert_close(logits_exp, logits_orig, rtol=1e-5, atol=1e-5)


def _round_trip(hf, model, tmp_path, **config):
    _peft_adapter(hf, tmp_path / "orig", **config)
    load_slot(model, 0, tmp_path / "orig")
    export_slot(model, 0, tmp_path / "exported", hf_config=hf.config)
    _assert_same_adapter(hf, tmp_path / "orig", tmp_path / "exported")
    _, theirs = _in_peft(hf, tmp_path / "exported")
    with torch.no_grad():
        ours = lm_logits(model, _ids(), torch.full((BATCH, SEQ), 0))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    return _config(tmp_path / "exported")


def test_q_and_v_only_round_trip(hf_and_megatron, tmp_path):
    hf, model = hf_and_megatron
    config = _round_trip(hf, model, tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 4
    assert not config["rank_pattern"] and not config["alpha_pattern"] and not config["layers_to_transform"]


def test_layer_subset_round_trip(hf_and_megatron, tmp_path):
    hf, model = hf_and_megatron
    config = _round_trip(
        hf,
        model,
        tmp_path,
        r=3,
        lora_alpha=5,
        target_modules=["k_proj", "gate_proj", "down_proj"],  # k without q/v, gate without up
        layers_to_transform=[0, 1],
    )
    assert config["layers_to_transform"] == [0, 1]
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj"]


def test_rslora_round_trip(hf_and_megatron, tmp_path):
    hf, model = hf_and_megatron
    config = _round_trip(hf, model, tmp_path, r=4, lora_alpha=6, use_rslora=True, target_modules=HF_TARGETS)
    assert config["use_rslora"] is True and config["r"] == 4 and config["lora_alpha"] == 6


def test_mixed_ranks_and_alphas_round_trip(hf_and_megatron, tmp_path):
    hf, model = hf_and_megatron
    config = _round_trip(
        hf,
        model,
        tmp_path,
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
        rank_pattern={"k_proj": 3, "model.layers.1.self_attn.o_proj": 5},
        alpha_pattern={"v_proj": 7.0, "up_proj": 3},  # q/k/v share one fused layer with 3 scales
    )
    assert config["rank_pattern"] == {"k_proj": 3, "layers.1.self_attn.o_proj": 5}
    assert config["alpha_pattern"] == {"up_proj": 3, "v_proj": 7.0}


def test_init_slot_exports_as_before(hf_and_megatron, tmp_path):
    hf, model = hf_and_megatron
    init_slot(model, 1, rank=3, alpha=7.0, seed=1)
    export_slot(model, 1, tmp_path / "fresh")
    config = _config(tmp_path / "fresh")
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        3,
        7.0,
        sorted(HF_TARGETS),
    )
    assert not (config["rank_pattern"] or config["alpha_pattern"] or config["layers_to_transform"])
    assert not config["use_rslora"]
    weights = load_file(str(tmp_path / "fresh" / "adapter_model.safetensors"))
    assert len(weights) == 2 * 7 * 3 and all(3 in t.shape for t in weights.values())


def test_training_outside_the_adapter_is_exported_exactly(hf_and_megatron, tmp_path):
    """A fused layer has one B for q/k/v: once training writes k rows or other parts' columns, the export
    takes what is needed to stay exact (k appears, q/v take the fused rank) in that layer only."""
    hf, model = hf_and_megatron
    _peft_adapter(hf, tmp_path / "orig", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    load_slot(model, 0, tmp_path / "orig")
    qkv = next(layer for layer in multi_lora_layers(model) if layer.key == "layers.0.linear_qkv")
    with torch.no_grad():
        qkv.lora_B[0, :, :4] += 0.1 * torch.randn(
            qkv.out_features, 4, generator=torch.Generator().manual_seed(1)
        )
    export_slot(model, 0, tmp_path / "exported")
    weights = load_file(str(tmp_path / "exported" / "adapter_model.safetensors"))
    a_shapes = {
        k.split(".")[4] + "." + k.split(".")[6]: t.shape[0] for k, t in weights.items() if "lora_A" in k
    }
    assert a_shapes == {
        "0.q_proj": 4, "0.k_proj": 4, "0.v_proj": 4, "1.q_proj": 2, "1.v_proj": 2, "2.q_proj": 2, "2.v_proj": 2,
    }  # fmt: skip
    _, theirs = _in_peft(hf, tmp_path / "exported")
    with torch.no_grad():
        ours = lm_logits(model, _ids(), torch.full((BATCH, SEQ), 0))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_shape_survives_checkpoints_and_old_checkpoints_still_load(hf_and_megatron, tmp_path):
    hf, model = hf_and_megatron
    _peft_adapter(hf, tmp_path / "orig", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    load_slot(model, 0, tmp_path / "orig")
    buffer = io.BytesIO()
    torch.save(slot_state(model, 0), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    load_slot_state(model, 1, state)
    export_slot(model, 1, tmp_path / "resumed")
    _assert_same_adapter(hf, tmp_path / "orig", tmp_path / "resumed")

    old = {k: v for k, v in state.items() if ".peft_" not in k}  # written before slots kept their shape
    load_slot_state(model, 1, old)
    export_slot(model, 1, tmp_path / "old")
    config = _config(tmp_path / "old")  # every module of a held layer, at the layer's rank (fused qkv: 8)
    assert sorted(config["target_modules"]) == ["k_proj", "q_proj", "v_proj"] and config["r"] == 8
    with torch.no_grad():
        ours = lm_logits(model, _ids(), torch.full((BATCH, SEQ), 1))
    torch.testing.assert_close(_in_peft(hf, tmp_path / "old")[1], ours, rtol=1e-5, atol=1e-5)


def test_peft_form_picks_the_smallest_exact_targeting():
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj")] + ["lm_head"]
    every = {n: (4, 8.0) for n in names}
    assert peft_form(every, names, False)["target_modules"] == ["lm_head", "q_proj", "v_proj"]
    some = {n: (4, 8.0) for n in names if ".2." not in n and n != "lm_head"}
    form = peft_form(some, names, False)
    assert (form["target_modules"], form["layers_to_transform"]) == (["q_proj", "v_proj"], [0, 1])
    ragged = {**some, "lm_head": (2, 8.0)}
    ragged.pop("model.layers.1.self_attn.v_proj")
    form = peft_form(ragged, names, True)
    assert form["target_modules"] == sorted(ragged) and form["use_rslora"]
    assert form["rank_pattern"] == {"lm_head": 2} and not form["alpha_pattern"]
    mixed = {**every, "model.layers.1.self_attn.q_proj": (6, 8.0), "lm_head": (4, 3.0)}
    form = peft_form(mixed, names, False)
    assert form["rank_pattern"] == {"layers.1.self_attn.q_proj": 6} and form["alpha_pattern"] == {
        "lm_head": 3.0
    }
