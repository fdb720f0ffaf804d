"""The embedded engine decodes a tiny Megatron MoE GPT (CPU, fp32) with its static MoE decode step:
rollout logprobs equal the trainer's, greedy decoding equals full forwards, for mixed adapters."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.lora import init_slot
from miles_multilora.rollout import EmbeddedEngine, GenerationRequest
from miles_multilora.scoring.logprobs import compute_logprobs
from tests.moe_helpers import randomize_b, tiny_moe_gpt
from tests.unit.test_rollout_embedded import (
    ADAPTERS,
    _char_tokenizer,
    _engine,
    _greedy_by_full_forwards,
    _mixed_requests,
)

MAX_SEQ_LEN = 96


def _model(kernels: str):
    model = tiny_moe_gpt(
        num_slots=4, max_rank=8, kernels=kernels, dispatcher="alltoall", vocab_size=128, max_seq_len=96
    )
    with torch.no_grad():
        model.output_layer.weight.mul_(20.0)  # peaked next-token distributions: no near-ties in argmax
    for slot, rank in ((0, 4), (2, 8)):
        init_slot(model, slot, rank=rank, alpha=16.0, seed=slot)
        randomize_b(model, slot, seed=slot, scale=0.2)
    return model


@pytest.fixture(scope="module", params=["torch", "triton"])
def model(request):
    return _model(request.param)


@pytest.fixture(scope="module")
def torch_model():
    return _model("torch")


@pytest.fixture(scope="module")
def tokenizer():
    return _char_tokenizer()


def test_mixed_adapter_rollout_logprobs_equal_recomputed(model, tokenizer):
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    reqs = _mixed_requests(tokenizer, SamplingSpec(temperature=0.7, top_p=0.95, max_new_tokens=10))
    results = engine.generate(reqs)
    model.eval()
    sequences = [r.prompt_ids + r.output_ids for r in results]
    with torch.no_grad():
        recomputed = compute_logprobs(model, sequences, [r.slot for r in results], 0.7, len(tokenizer))
        swapped = compute_logprobs(
            model, sequences, [(-1, 0, 2)[(r.slot + 2) % 3] for r in results], 0.7, len(tokenizer)
        )
    for req, res, lp, other in zip(reqs, results, recomputed, swapped, strict=True):
        assert res.slot == req.slot
        start = len(res.prompt_ids) - 1
        assert (lp[start:].cpu() - torch.tensor(res.logprobs)).abs().max() <= 1e-5
        assert (other[start:].cpu() - torch.tensor(res.logprobs)).abs().max() > 1e-3


def test_mixed_adapter_greedy_equals_full_forwards(torch_model, tokenizer):
    model = torch_model
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    reqs = _mixed_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=8))
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.output_ids == _greedy_by_full_forwards(model, req.prompt_ids, 8, len(tokenizer), req.slot)


def test_a_model_without_lora_decodes_its_base(tokenizer):
    """No MultiLoRA at all: the engine still runs the static MoE decode (base experts only)."""
    plain = tiny_moe_gpt(lora=False, vocab_size=128, max_seq_len=96)
    with torch.no_grad():
        plain.output_layer.weight.mul_(20.0)
    engine = EmbeddedEngine(plain, vocab_size=len(tokenizer), max_seq_len=MAX_SEQ_LEN, tokenizer=tokenizer)
    ids = tokenizer.encode("What is 2+3?")
    result = engine.generate(
        [GenerationRequest.for_base(ids, SamplingSpec(temperature=0.0, max_new_tokens=6))]
    )
    assert result[0].output_ids == _greedy_by_full_forwards(plain, ids, 6, len(tokenizer))
