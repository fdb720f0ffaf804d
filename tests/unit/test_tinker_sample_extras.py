"""The sample request's extras on one in-process trainer rank (tiny model, fp32 CPU): target prompt
logprobs, alternative-token draws at each prompt position and the top-k at each sampled token, each
exact against the fp32 log-softmax of the module's full logits; their request parsing and wire
form (read back by the SDK's own decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker.proto.response_conv import deserialize_sample_response

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.scoring.logprobs import forward_logits
from miles_multilora.tinker import params
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.requests import (
    Datum,
    ForwardBackwardRequest,
    PromptScores,
    PromptScoring,
    SampleOutput,
    TargetIds,
    TinkerError,
)
from miles_multilora.tinker.wire import encode_samples

TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3]


def _full_logprobs(backend: TinkerBackend, slot: int, tokens: list[int]) -> torch.Tensor:
    """fp32 log-softmax of the module's full logits (no chunked head) of ``tokens`` on ``slot``."""
    rank = backend.rank
    ids = torch.tensor([tokens], device=next(rank.model.parameters()).device)
    with torch.no_grad():
        logits = forward_logits(rank.model, ids, [slot])[0, :, : rank.vocab_size]
    return torch.log_softmax(logits.float(), dim=-1)


def _trained(backend: TinkerBackend) -> int:
    """Model ``a`` with LoRA weights that move the distribution; its slot."""
    backend.create_model("a", rank=4, seed=1)
    datum = Datum(TEXT[:-1], {"target_tokens": TEXT[1:], "weights": [1.0] * (len(TEXT) - 1)})
    backend.forward_backward([ForwardBackwardRequest("a", [datum])])
    backend.optim_step("a", lr=3e-2)
    return backend.model("a").slot


def test_target_logprobs_and_alternative_draws_are_the_full_distributions(backend: TinkerBackend) -> None:
    slot = _trained(backend)
    full = _full_logprobs(backend, slot, TEXT)[:-1].double()  # row i: the distribution of TEXT[i + 1]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, backend.rank.vocab_size, (len(TEXT) - 1, 3))
    ids[0] = -1  # rows and cells asking nothing get 0.0
    ids[4, 1] = -1
    scores = backend.score_prompt("a", TEXT, PromptScoring(targets=TargetIds(ids)))
    assert scores.logprobs is None and scores.topk_ids is None and scores.alt_ids is None
    expected = full.gather(-1, torch.tensor(ids).clamp(min=0)).numpy()
    expected[ids < 0] = 0.0
    np.testing.assert_allclose(scores.target_logprobs, expected, atol=1e-5)
    base = backend.score_prompt(None, TEXT, PromptScoring(targets=TargetIds(ids)))  # the base model's
    reference = _full_logprobs(backend, -1, TEXT)[:-1].double().gather(-1, torch.tensor(ids).clamp(min=0))
    np.testing.assert_allclose(base.target_logprobs[ids >= 0], reference.numpy()[ids >= 0], atol=1e-5)
    assert np.abs(base.target_logprobs - scores.target_logprobs).max() > 1e-3

    k = 4000  # many draws: their frequencies follow the distribution at the temperature
    for temperature in (1.0, 0.5):
        alt = backend.score_prompt("a", TEXT, PromptScoring(alt_k=k, temperature=temperature, seed=7))
        assert alt.alt_ids.shape == alt.alt_logprobs.shape == (len(TEXT) - 1, k)
        got = full.gather(-1, torch.tensor(alt.alt_ids)).numpy()
        np.testing.assert_allclose(alt.alt_logprobs, got, atol=1e-5)  # the model's logprobs (T = 1)
        p = torch.softmax(full / temperature, dim=-1).numpy()
        for i in range(len(TEXT) - 1):
            top = int(p[i].argmax())
            freq = float((alt.alt_ids[i] == top).mean())
            assert abs(freq - p[i, top]) < 5 * np.sqrt(p[i, top] * (1 - p[i, top]) / k) + 1e-3
    again = backend.score_prompt("a", TEXT, PromptScoring(alt_k=5, seed=7)).alt_ids
    assert np.array_equal(again, backend.score_prompt("a", TEXT, PromptScoring(alt_k=5, seed=7)).alt_ids)
    assert not np.array_equal(again, backend.score_prompt("a", TEXT, PromptScoring(alt_k=5, seed=8)).alt_ids)
    greedy = backend.score_prompt("a", TEXT, PromptScoring(alt_k=3, temperature=0.0))
    assert (greedy.alt_ids == full.argmax(-1).numpy()[:, None]).all()

    with pytest.raises(TinkerError, match=r"target_prompt_logprobs: has 5 rows for a prompt of 12 tokens"):
        backend.score_prompt("a", TEXT, PromptScoring(targets=TargetIds(ids[:5])))
    too_big = ids.copy()
    too_big[1, 0] = backend.rank.vocab_size
    with pytest.raises(TinkerError, match=r"target_prompt_logprobs: token ids must be in 0\.\."):
        backend.score_prompt("a", TEXT, PromptScoring(targets=TargetIds(too_big)))


def test_topk_at_each_sampled_token_is_the_full_distributions_best(backend: TinkerBackend) -> None:
    slot = _trained(backend)
    prompt, k = TEXT[:4], 5
    results = backend.sample("a", prompt, 3, SamplingSpec(temperature=1.0, max_new_tokens=6), seed=3)
    topk = backend.score_samples("a", prompt, [r.output_ids for r in results], k)
    for r, (ids, values) in zip(results, topk, strict=True):
        full = _full_logprobs(backend, slot, prompt + r.output_ids)[len(prompt) - 1 : -1]
        best, best_ids = full.topk(k, dim=-1)
        assert torch.equal(torch.tensor(ids), best_ids)
        np.testing.assert_allclose(np.asarray(values), best.numpy(), atol=1e-5)
        own = full.gather(-1, torch.tensor(r.output_ids).view(-1, 1)).view(-1)
        np.testing.assert_allclose(r.logprobs, own.numpy(), atol=1e-4)  # what the sampler drew from


def _body(**fields: object) -> dict:
    return {"prompt_logprobs": False, **fields}


def test_the_extras_parse_with_their_caps_and_go_back_in_the_requests_layout() -> None:
    limits = TinkerConfig()
    ids = np.full((4, 3), -1, np.int64)
    ids[1, 0], ids[3, 2], ids[3, 1] = 7, 9, 2
    sparse = {"data": [7, 2, 9], "dtype": "int64", "shape": [4, 3],
              "sparse_crow_indices": [0, 0, 1, 1, 3], "sparse_col_indices": [0, 1, 2]}  # fmt: skip
    scoring = params.prompt_scoring(
        _body(target_prompt_logprobs=sparse, prompt_alt_tokens_k=2), limits, 0.7, 11
    )
    assert np.array_equal(scoring.targets.ids, ids) and scoring.targets.csr is not None
    assert (scoring.alt_k, scoring.temperature, scoring.seed, scoring.scores_prompt) == (2, 0.7, 11, False)
    dense = {"data": ids.reshape(-1).tolist(), "dtype": "int64", "shape": [4, 3]}
    assert np.array_equal(params.prompt_scoring(_body(target_prompt_logprobs=dense), limits).targets.ids, ids)
    assert params.sample_topk({"topk_sample_logprobs": 3}, limits) == 3
    for body, match in [
        ({"topk_sample_logprobs": 21}, r"topk_sample_logprobs: 21 is over the limit of 20 \(tinker\.max_topk_sample"),
        ({"prompt_alt_tokens_k": 17}, r"prompt_alt_tokens_k: 17 is over the limit of 16 \(tinker\.max_prompt_alt"),
        ({"target_prompt_logprobs": {**dense, "dtype": "float32"}}, r"target_prompt_logprobs\.dtype: must be int64"),
        ({"target_prompt_logprobs": {**dense, "shape": [4, 65]}}, r"K=65; K must be in 1\.\.64 \(tinker\.max_target"),
        ({"target_prompt_logprobs": {**dense, "data": [-1] * 12}}, "names no token id"),
        ({"target_prompt_logprobs": {**sparse, "sparse_crow_indices": [0, 1, 1, 3]}}, "sparse_crow_indices"),
        ({"target_prompt_logprobs": {**sparse, "sparse_col_indices": [0, 2, 1]}}, "sparse_col_indices"),
    ]:  # fmt: skip
        with pytest.raises(TinkerError, match=match):
            params.sample_topk(body, limits)
            params.prompt_scoring(body, limits)

    values = np.where(ids >= 0, -np.arange(12, dtype=np.float32).reshape(4, 3), 0.0).astype(np.float32)
    alt_ids, alt_lp = np.array([[1, 2]] * 4), np.full((4, 2), -0.5, np.float32)
    for targets in (scoring.targets, TargetIds(ids)):
        scores = PromptScores(1, 5, None, 0, targets=targets, target_logprobs=values,
                              alt_ids=alt_ids, alt_logprobs=alt_lp)  # fmt: skip
        got = deserialize_sample_response(encode_samples(SampleOutput([], scores)))
        assert (got.target_prompt_logprobs.sparse_crow_indices is not None) == (targets.csr is not None)
        np.testing.assert_array_equal(got.target_prompt_logprobs.to_numpy(), values)
        np.testing.assert_array_equal(got.prompt_alt_tokens.tokens.to_numpy(), alt_ids)
        np.testing.assert_array_equal(got.prompt_alt_tokens.logprobs.to_numpy(), alt_lp)
