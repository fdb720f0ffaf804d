"""The LM head's logits are fp32 on both sides of the sampler-trainer comparison: a bf16 model's
logits are never rounded to bf16, in the engine's decode nor in the trainer's scoring."""

from __future__ import annotations

import torch

from miles_multilora.models.compat import init_distributed, lm_head_logits
from miles_multilora.models.provider import build_tiny_gpt
from miles_multilora.rollout.paged_model import PagedModel
from miles_multilora.scoring.chunked_logprobs import chunked_token_logprobs


def _bf16_head() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(6, 64, generator=gen) * 4).bfloat16()  # logits ~ +-30: bf16 spacing 0.125
    weight = torch.randn(128, 64, generator=gen).bfloat16()
    return hidden, weight


def test_bf16_operands_give_fp32_logits_that_bf16_would_round():
    hidden, weight = _bf16_head()
    logits = lm_head_logits(hidden, weight)
    exact = hidden.double() @ weight.double().t()
    assert logits.dtype == torch.float32 and logits.shape == (6, 128)
    torch.testing.assert_close(logits.double(), exact, rtol=1e-6, atol=1e-4)
    rounded = (hidden @ weight.t()).double()  # the model's dtype: what the head wrote before
    assert (rounded - exact).abs().max() > 100 * (logits.double() - exact).abs().max()
    three_d = lm_head_logits(hidden.view(2, 3, 64), weight)
    assert three_d.shape == (2, 3, 128) and torch.equal(three_d.view(6, 128), logits)


def test_the_trainers_chunked_logprobs_use_the_unrounded_logits():
    hidden, weight = _bf16_head()
    targets = torch.arange(6) * 7
    got = chunked_token_logprobs(hidden, weight, targets, torch.ones(6), vocab_size=128, chunk=4)
    want = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)[torch.arange(6), targets]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


def test_the_engines_decode_logits_are_fp32_for_a_bf16_model():
    init_distributed()
    model = build_tiny_gpt(vocab_size=128, max_seq_len=64, seed=0, dtype="bfloat16")
    paged = PagedModel(model, 64)
    device = model.output_layer.weight.device
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    logits = paged._logits(hidden, normed=True)
    assert logits.dtype == torch.float32 and logits.shape == (5, 128)
    torch.testing.assert_close(logits, lm_head_logits(hidden[0], model.output_layer.weight), rtol=0, atol=0)
