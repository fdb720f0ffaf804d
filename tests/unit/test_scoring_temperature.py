"""The sampling temperature travels on the result: each engine tags a result with its request's
temperature, and the RL rows score each sample at it (greedy at 1): the trainer's logprobs are the
rollout's without reading the adapter's spec again."""

from __future__ import annotations

import torch

from miles_multilora.algo import AlgoConfig
from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.data.records import PromptItem
from miles_multilora.rl.rollout import Group
from miles_multilora.rl.train import policy_rows
from miles_multilora.rollout import GenerationRequest
from miles_multilora.rollout.sglang_engine import _parse_result
from miles_multilora.rollout.vllm_engine import _parse_choice
from miles_multilora.scoring.logprobs import right_pad
from miles_multilora.trainer.primitives import row_logprobs
from tests.unit.test_rollout_embedded import ADAPTERS, _engine, _mixed_requests, model, tokenizer  # noqa: F401


def test_http_engines_tag_each_result_with_its_requests_temperature():
    req = GenerationRequest.for_base([1], SamplingSpec(temperature=0.7))
    choice = {
        "index": 0, "text": "ab", "finish_reason": "length", "stop_reason": None, "token_ids": [0, 1],
        "logprobs": {"tokens": ["token_id:0", "token_id:1"], "token_logprobs": [-0.1, -0.2]},
    }  # fmt: skip
    assert _parse_choice(req, choice, 0).temperature == 0.7
    body = {
        "text": "a",
        "meta_info": {"output_token_logprobs": [[-0.1, 0, None]], "finish_reason": {"type": "length"}},
    }
    greedy = GenerationRequest.for_base([1], SamplingSpec(temperature=0.0))
    assert _parse_result(greedy, body).temperature == 0.0


def test_rows_score_each_sample_at_its_results_temperature_greedy_at_one(model, tokenizer):  # noqa: F811
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    hot = _mixed_requests(tokenizer, SamplingSpec(temperature=0.7, max_new_tokens=6))[:3]
    greedy = _mixed_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=6))[:3]
    results = engine.generate(hot + greedy)
    assert [r.temperature for r in results] == [0.7] * 3 + [0.0] * 3

    item = PromptItem("math", 0, "math:0:0", 0, "p", None)
    groups = [
        Group("math", item, hot, results[:3], rewards=[1.0, 0.0, 0.5]),
        Group("math", item, greedy, results[3:], rewards=[0.0, 1.0, 0.5]),
    ]
    rows = policy_rows(groups, AlgoConfig())
    assert [r.temperature for r in rows] == [0.7] * 3 + [0.0] * 3
    model.eval()
    ids, _ = right_pad([r.tokens for r in rows], device=next(model.parameters()).device)
    with torch.no_grad():
        got = row_logprobs(model, ids, rows, [r.slot for r in rows], len(tokenizer), 64)
    for i, row in enumerate(rows):  # the rollout's own logprobs (greedy: taken at T = 1)
        want = torch.tensor(row.values["old_logprobs"])
        assert (got[i, : row.width].cpu() - want).abs().max() <= 1e-5


def test_rows_mark_the_tokens_their_adapters_current_version_sampled():
    """``policy_rows`` with the adapters' versions marks each output token sampled by that version
    (1) or an older one (0): continuous rollout's tokens one version behind are not on-policy."""
    from miles_multilora.rollout.types import GenerationResult

    def result(versions: list[int]) -> GenerationResult:
        n = len(versions)
        return GenerationResult(
            "math", versions[0], 0, [5, 6], list(range(n)), [-0.5] * n, "length", token_versions=versions
        )

    item = PromptItem("math", 0, "math:0:0", 0, "p", None)
    results = [result([2, 2, 3]), result([3, 3])]
    groups = [Group("math", item, [], results, rewards=[1.0, 0.0])]
    rows = policy_rows(groups, AlgoConfig(), {"math": 3})
    assert [r.values["on_policy"] for r in rows] == [[0.0, 0.0, 1.0], [1.0, 1.0]]
    assert "on_policy" not in policy_rows(groups, AlgoConfig())[0].values
