"""GRPO advantages and DAPO overlong shaping against hand-computed values."""

import math

import pytest
import torch

from miles_multilora.algo import group_advantages, grpo_advantages, overlong_penalty


def test_group_advantages_std_normalised_ragged_groups():
    # group 0: [1, 0, 0, 1] mean .5, unbiased std sqrt(1/3); group 1: [2, 4] mean 3, std sqrt(2);
    # group 2: all equal -> 0; group 3: single sample -> 0
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 3.0, 3.0, 3.0, 5.0]
    groups = [0, 0, 0, 0, 1, 1, 2, 2, 2, 3]
    adv = group_advantages(rewards, groups, std_normalize=True, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    b = 1.0 / math.sqrt(2)
    expected = [a, -a, -a, a, -b, b, 0.0, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_advantages_mean_centred_only_and_unsorted_ids():
    adv = group_advantages([4.0, 1.0, 0.0, 2.0], [5, 9, 5, 9], std_normalize=False)
    assert adv.tolist() == pytest.approx([2.0, -0.5, -2.0, 0.5])


def test_grpo_advantages_2d_and_eps():
    adv = grpo_advantages(torch.tensor([[0.0, 1.0], [1.0, 1.0]]), std_normalize=True, eps=1.0)
    # centred +-0.5, std sqrt(0.5) = 0.7071 -> 0.5 / 1.7071
    assert adv.shape == (2, 2)
    assert adv[0].tolist() == pytest.approx([-0.5 / 1.70710678, 0.5 / 1.70710678], abs=1e-6)
    assert adv[1].tolist() == [0.0, 0.0]


def test_group_advantages_shape_mismatch():
    with pytest.raises(ValueError, match="same length"):
        group_advantages([1.0, 2.0], [0])


@pytest.mark.parametrize(
    ("length", "expected"),
    [(10, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (20, -1.0)],
)
def test_overlong_penalty_linear_in_buffer(length, expected):
    # max_new_tokens 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -1
    assert overlong_penalty(length, 16, 4, factor=1.0) == pytest.approx(expected)


def test_overlong_penalty_factor_and_disabled():
    assert overlong_penalty(15, 16, 4, factor=0.5) == pytest.approx(-0.375)
    assert overlong_penalty(16, 16, 0) == 0.0
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(3, 4, 8)
