"""The sample request's extra scores, by the trainer's own forward on a slot's weights.

Target prompt logprobs (the logprobs of chosen ids at chosen prompt positions), draws from the
next-token distribution at every prompt position (``prompt_alt_tokens_k``), and the top-k at each
sampled token (``topk_sample_logprobs``). Every logprob is the model's, at temperature 1, from an
fp32 log-softmax over the whole vocabulary, as the prompt's own logprobs are
(:meth:`~miles_multilora.tinker.backend.TinkerBackend.score_prompt`).
"""

from __future__ import annotations

import numpy as np

from miles_multilora.tinker.losses import tinker_loss
from miles_multilora.tinker.requests import PromptScores, PromptScoring, TargetIds
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import RankPrimitives


def target_logprobs(rank: RankPrimitives, slot: int, prompt: list[int], targets: TargetIds) -> np.ndarray:
    """float32 of the targets' shape: ``[i, j]`` is log p(targets[i, j] | prompt[: i + 1]), 0.0 where
    the cell asks nothing. One forward of the prompt scores every named cell (a forward-only
    ``cross_entropy`` pass, as a training client's ``forward`` of ``[N, K]`` targets)."""
    rows, cols = np.nonzero(targets.ids >= 0)
    ids = targets.ids[rows, cols]
    row = ScoredRow(slot, list(prompt), rows.tolist(), ids.tolist(), values={"weights": [0.0] * len(ids)})
    result = rank.forward_backward([row], tinker_loss({0: ("cross_entropy", {})}), backward=False)
    out = np.zeros(targets.ids.shape, np.float32)
    out[rows, cols] = result.logprobs[0]
    return out


def prompt_alternatives(
    rank: RankPrimitives, slot: int, prompt: list[int], k: int, temperature: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``k`` independent draws, with replacement, from the next-token distribution at each prompt
    position after the first, at ``temperature`` (0: the most likely token), seeded by ``seed``:
    int64 ids and their float32 logprobs (temperature 1), both ``[len(prompt) - 1, k]``. The
    draws come from the whole distribution (the forward's full-vocabulary top-k, sorted), by
    inverse CDF in float64."""
    positions = len(prompt) - 1
    (score,) = rank.score([ScoredRow(slot, list(prompt), list(range(positions)))], rank.vocab_size)
    ids = np.asarray(score.topk_ids, np.int64).reshape(positions, -1)  # most likely first
    logprobs = np.asarray(score.topk_logprobs, np.float64).reshape(positions, -1)
    if temperature == 0:
        picks = np.zeros((positions, k), np.int64)
    else:
        weights = np.exp((logprobs - logprobs[:, :1]) / temperature)
        cdf = np.cumsum(weights, axis=1)
        draws = np.random.default_rng(seed).random((positions, k)) * cdf[:, -1:]
        picks = np.stack([np.searchsorted(cdf[i], draws[i], side="right") for i in range(positions)])
        picks = np.minimum(picks, ids.shape[1] - 1)
    return (
        np.take_along_axis(ids, picks, axis=1),
        np.take_along_axis(logprobs, picks, axis=1).astype(np.float32),
    )


def sampled_topk(
    rank: RankPrimitives, slot: int, prompt: list[int], outputs: list[list[int]], k: int
) -> list[tuple[list[list[int]], list[list[float]]]]:
    """For each output, the ``k`` most likely tokens (ids, logprobs, highest first) at each of its
    positions: the distribution its token ``t`` was drawn from, given the prompt and the tokens
    before ``t``. One row per output, scored together."""
    start = len(prompt) - 1
    rows = [
        ScoredRow(slot, list(prompt) + list(out), list(range(start, start + len(out)))) for out in outputs
    ]
    return [(s.topk_ids or [], s.topk_logprobs or []) for s in rank.score(rows, k)]


def score_prompt(rank: RankPrimitives, slot: int, prompt: list[int], scoring: PromptScoring) -> PromptScores:
    """What ``scoring`` asks of ``prompt`` under ``slot`` (-1: the base model): the logprob of each
    scored position and the top-k tokens there, the target ids' logprobs and the alternative draws
    (temperature 1, fp32 log-softmax)."""
    n = len(prompt)
    first = 1 if scoring.last_n is None else n - scoring.last_n
    scores = PromptScores(first, n, None, scoring.topk, targets=scoring.targets)
    if scoring.scores_prompt:
        (score,) = rank.score([ScoredRow(slot, list(prompt), list(range(first - 1, n - 1)))], scoring.topk)
        scores.logprobs = score.logprobs if scoring.logprobs else None
        scores.topk_ids, scores.topk_logprobs = score.topk_ids, score.topk_logprobs
    if scoring.targets is not None:
        scores.target_logprobs = target_logprobs(rank, slot, prompt, scoring.targets)
    if scoring.alt_k:
        scores.alt_ids, scores.alt_logprobs = prompt_alternatives(
            rank, slot, prompt, scoring.alt_k, scoring.temperature, scoring.seed
        )
    return scores
