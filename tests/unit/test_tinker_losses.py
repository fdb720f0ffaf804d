"""Tinker's built-in losses against their reference formulas: values and gradients per token."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.errors import SpecError
from miles_multilora.tinker.losses import check_loss, per_token_loss
from miles_multilora.trainer.primitives import MicroBatch, ScoredRow


def _batch(logprobs: torch.Tensor, sampled: list[float], adv: list[float]) -> MicroBatch:
    row = ScoredRow(0, [0] * 5, list(range(4)), values={"logprobs": sampled, "advantages": adv})
    return MicroBatch([row], logprobs, torch.ones_like(logprobs))


def test_cispo_is_the_clipped_ratio_as_a_detached_coefficient_of_the_logprob() -> None:
    current = torch.tensor([[-1.0, -0.2, -3.0, -0.5]], requires_grad=True)
    sampled, adv = [-1.5, -0.1, -0.5, -0.5], [1.0, -2.0, 0.5, 3.0]
    config = check_loss("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2})
    loss = per_token_loss("cispo", config, _batch(current, sampled, adv))
    ratio = torch.exp(current.detach() - torch.tensor([sampled]))
    coeff = ratio.clamp(0.5, 1.2)  # 1.65 -> 1.2 (capped), 0.90, 0.08 -> 0.5 (floored), 1.0
    torch.testing.assert_close(loss, -coeff * current.detach() * torch.tensor([adv]))
    loss.sum().backward()
    torch.testing.assert_close(current.grad, -coeff * torch.tensor([adv]))  # no gradient through the ratio


def test_cispo_defaults_and_bad_configs() -> None:
    assert check_loss("cispo", None) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    with pytest.raises(SpecError, match="cispo needs"):
        check_loss("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0})
    with pytest.raises(SpecError, match="takes no"):
        check_loss("cispo", {"beta": 1.0})
    with pytest.raises(SpecError, match="unknown loss 'gspo'"):
        check_loss("gspo", None)
