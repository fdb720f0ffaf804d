"""Micro-batches by token budget: every row exactly once, within the budget, little padding."""

from __future__ import annotations

import random

import pytest

from miles_multilora.trainer.microbatch import micro_batches, padded_tokens


def test_without_a_budget_rows_keep_their_order_in_groups_of_max_rows():
    assert micro_batches([5, 1, 9, 2, 7], max_rows=2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("seed", range(5))
def test_a_token_budget_covers_every_row_once_within_the_budget_and_pads_less(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(20, 400) for _ in range(200)]
    budget = 4096
    batches = micro_batches(lengths, max_rows=64, max_tokens=budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 64 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget)
    by_count = micro_batches(lengths, max_rows=len(batches[0]))  # same rows per batch, unsorted
    assert padded_tokens(lengths, batches) < 0.8 * padded_tokens(lengths, by_count)
    assert padded_tokens(lengths, batches) < 1.1 * sum(lengths)  # nearly no padding left


def test_a_row_longer_than_the_budget_goes_alone():
    assert micro_batches([50, 900, 60], max_rows=8, max_tokens=200) == [[1], [2, 0]]
