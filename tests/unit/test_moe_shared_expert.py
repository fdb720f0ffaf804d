"""A tiny Megatron MoE GPT with a gated shared expert beside its routed experts, LoRA on both (CPU,
fp32): co-training equals training alone, the embedded engine's decode logprobs equal the trainer's
scoring, and what the model config refuses."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec
from miles_multilora.config.sections.model import TinyModelConfig
from miles_multilora.errors import ConfigError
from miles_multilora.lora import init_slot, multi_lora_layers
from miles_multilora.optim import SlotAdamW
from miles_multilora.scoring.logprobs import compute_logprobs
from miles_multilora.testing.lora import mixed_train_step
from tests.moe_helpers import randomize_b, tiny_moe_gpt
from tests.unit.test_rollout_embedded import ADAPTERS, _char_tokenizer, _engine, _mixed_requests

SHARED = dict(moe_shared_expert_ffn_hidden_size=40, moe_shared_expert_gate=True)
VOCAB, SEQ = 64, 8


def _shared_layers(model) -> list:
    return [la for la in multi_lora_layers(model) if ".shared_experts." in la.key]


def _slot_tensors(model, slot: int) -> list[torch.Tensor]:
    return [p[slot].detach().clone() for la in multi_lora_layers(model) for p in (la.lora_A, la.lora_B)]


def _data(adapter: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1000 * adapter + step))


def _trained(slots) -> tuple[torch.nn.Module, SlotAdamW]:
    model = tiny_moe_gpt(num_slots=3, max_rank=4, **SHARED)
    opt = SlotAdamW(model)
    for s in slots:
        init_slot(model, s, rank=2 + s % 2, alpha=4.0 + s, seed=100 + s)
        opt.configure_slot(s, OptimizerSpec(lr=2e-2, clip_grad=0.0, weight_decay=0.1 * s))
    for step in range(3):
        mixed_train_step(model, opt, {s: _data(s, step) for s in slots})
    return model, opt


def test_cotrained_adapter_equals_adapter_trained_alone_on_a_shared_expert_model():
    target = 2
    together, opt_t = _trained(range(3))
    alone, opt_a = _trained([target])
    assert opt_t.steps == [3, 3, 3] and opt_a.steps == [0, 0, 3]
    for got, want in zip(_slot_tensors(together, target), _slot_tensors(alone, target), strict=True):
        # fp32 rounding only (other row counts per expert GEMM); a leak between slots moves them ~1e-2
        assert ((got - want).norm() / want.norm()).item() <= 2e-5
    shared = _shared_layers(alone)
    assert len(shared) == 4 and all(la.lora_B[target].abs().sum() > 0 for la in shared)


@pytest.fixture(scope="module")
def tokenizer():
    return _char_tokenizer()


def test_decode_logprobs_with_shared_expert_lora_equal_the_trainers(tokenizer):
    model = tiny_moe_gpt(
        num_slots=4,
        max_rank=8,
        kernels="torch",
        dispatcher="alltoall",
        vocab_size=128,
        max_seq_len=96,
        **SHARED,
    )
    with torch.no_grad():
        model.output_layer.weight.mul_(20.0)  # peaked next-token distributions
    for slot, rank in ((0, 4), (2, 8)):
        init_slot(model, slot, rank=rank, alpha=16.0, seed=slot)
        randomize_b(model, slot, seed=slot, scale=0.2)
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    reqs = _mixed_requests(tokenizer, SamplingSpec(temperature=0.7, top_p=0.95, max_new_tokens=10))
    results = engine.generate(reqs)
    model.eval()
    sequences = [r.prompt_ids + r.output_ids for r in results]
    slots = [r.slot for r in results]
    with torch.no_grad():
        recomputed = compute_logprobs(model, sequences, slots, 0.7, len(tokenizer))
        for layer in _shared_layers(model):  # the shared expert's LoRA moves the logprobs
            layer.lora_B.data[[0, 2]] = 0.0
        without = compute_logprobs(model, sequences, slots, 0.7, len(tokenizer))
    for res, lp, other in zip(results, recomputed, without, strict=True):
        start = len(res.prompt_ids) - 1
        assert (lp[start:].cpu() - torch.tensor(res.logprobs)).abs().max() <= 1e-5
        if res.slot >= 0:
            assert (other[start:].cpu() - torch.tensor(res.logprobs)).abs().max() > 1e-3


def test_overlapped_shared_expert_is_refused_and_the_model_unchanged():
    model = tiny_moe_gpt(lora=False, **SHARED)
    moe = model.decoder.layers[0].mlp
    moe.config.moe_shared_expert_overlap = True
    from miles_multilora.lora import apply_multi_lora

    with pytest.raises(ConfigError) as err:
        apply_multi_lora(model, "all-linear", num_slots=2, max_rank=2)
    assert err.value.key == "model.moe_shared_expert_overlap"
    assert type(moe.shared_experts.linear_fc1).__name__ == "ColumnParallelLinear"


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        (dict(moe_shared_expert_ffn_hidden_size=16), "model.tiny.moe_shared_expert_ffn_hidden_size"),
        (
            dict(num_experts=4, moe_shared_expert_ffn_hidden_size=0),
            "model.tiny.moe_shared_expert_ffn_hidden_size",
        ),
        (dict(num_experts=4, moe_shared_expert_gate=True), "model.tiny.moe_shared_expert_gate"),
    ],
)
def test_tiny_shared_expert_fields_are_checked(fields, key):
    with pytest.raises(ConfigError) as err:
        TinyModelConfig(**fields).validate()
    assert err.value.key == key
    TinyModelConfig(
        num_experts=4, moe_shared_expert_ffn_hidden_size=16, moe_shared_expert_gate=True
    ).validate()
