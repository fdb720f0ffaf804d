"""Logprob definition and seeded top-k / top-p sampling (pure torch)."""

from __future__ import annotations

import math

import torch

from miles_multilora.scoring.temperature import token_logprobs
from miles_multilora.testing.sampling import filter_top_k_top_p, make_generator, sample_token


def test_logprobs_use_the_full_tempered_distribution_of_the_real_vocab():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 9.0, 9.0]])  # the last two ids are vocab padding
    targets = torch.tensor([1])
    expected = torch.log_softmax(logits[0, :4] / 0.5, -1)[1]
    assert torch.allclose(token_logprobs(logits, targets, 0.5, vocab_size=4), expected.view(1))
    greedy = token_logprobs(logits, targets, torch.tensor([0.0]), vocab_size=4)  # T = 0 counts as 1
    assert torch.allclose(greedy, torch.log_softmax(logits[0, :4], -1)[1].view(1))
    per_row = token_logprobs(
        logits.repeat(2, 1), torch.tensor([1, 1]), torch.tensor([0.5, 0.0]), vocab_size=4
    )
    assert torch.allclose(per_row, torch.stack([expected, greedy[0]]))


def test_logprobs_are_differentiable():
    logits = torch.randn(2, 3, 8, requires_grad=True)
    token_logprobs(logits, torch.randint(0, 6, (2, 3)), 0.7, vocab_size=6).sum().backward()
    assert logits.grad is not None and logits.grad[..., 6:].abs().sum() == 0
    assert logits.grad[..., :6].abs().sum() > 0


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    assert torch.isfinite(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [False, True, False, True]
    assert torch.isfinite(filter_top_k_top_p(logits, -1, 0.8)).tolist() == [False, True, False, True]
    assert torch.isfinite(filter_top_k_top_p(logits, -1, 0.81)).tolist() == [False, True, True, True]
    assert torch.isfinite(filter_top_k_top_p(logits, -1, 0.01)).tolist() == [False, True, False, False]
    assert torch.isfinite(filter_top_k_top_p(logits, 3, 0.5)).tolist() == [False, True, False, False]


def test_seeded_sampling_reproducible_and_within_the_nucleus():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))

    def draws(seed: int, n: int = 300, **kw) -> list[int]:
        gen = make_generator(seed, torch.device("cpu"))
        return [
            sample_token(logits, kw.get("t", 1.0), kw.get("k", -1), kw.get("p", 1.0), gen) for _ in range(n)
        ]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert set(draws(3, p=0.8)) == {1, 3}
    assert draws(3, k=1, t=2.0, n=20) == [1] * 20
    assert sample_token(logits, 0.0, -1, 1.0, None) == 1
    freq = draws(5, n=2000).count(1) / 2000
    assert math.isclose(freq, 0.5, abs_tol=0.05)
