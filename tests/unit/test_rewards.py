"""Built-in and custom reward functions, answer extraction and reward shaping."""

import sys
import textwrap

import pytest

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data import RewardSample, build_reward
from miles_multilora.data.datasets import load_adapter_dataset
from miles_multilora.data.extraction import extract_answer, normalize_answer, reference_answer


def _spec(reward, dataset=None, **over):
    data = {
        "name": "r",
        "num_steps": 1,
        "dataset": dataset or {"path": "tests/data/gsm8k_mini.jsonl"},
        "reward": reward,
        "sampling": {"max_new_tokens": 20},
    }
    data.update(over)
    return parse_adapter_spec(data)


def _sample(completion, answer="Work.\n#### 1,200", **kw):
    return RewardSample(prompt="p", completion=completion, answer=answer, **kw)


@pytest.mark.parametrize(
    ("text", "rule", "expected"),
    [
        ("so 3 + 4 = 7\n#### 7", "hash", "7"),
        ("#### 5\nlater #### 12 apples", "hash", "12 apples"),
        ("the answer is \\boxed{\\frac{1}{2}} done", "boxed", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{x^{2}}", "boxed", "x^{2}"),
        ("I had 3 apples, then $1,250.50 left.", "last_number", "$1,250.50"),
        ("minus -42 and", "last_number", "-42"),
        ("no digits", "last_number", None),
        ("  Paris \n", "none", "Paris"),
        ("nothing", "boxed", None),
    ],
)
def test_extraction_rules(text, rule, expected):
    assert extract_answer(text, rule) == expected


def test_normalize_and_reference():
    assert normalize_answer("$1,200.") == "1200"
    assert normalize_answer("3.50") == "3.5"
    assert normalize_answer(" Hello  World ") == "hello world"
    assert reference_answer("steps\n#### 72") == "72"
    assert reference_answer("so \\boxed{8}") == "8"


def test_exact_match_with_extraction_rules():
    hash_fn = build_reward(_spec({"type": "exact_match", "extract": "hash"}))
    assert hash_fn.score(_sample("1000 + 200 = 1200\n#### 1200")).reward == 1.0
    assert hash_fn.score(_sample("#### 1201")).correct is False
    assert hash_fn.score(_sample("The answer is 1200")).reward == 0.0  # no #### marker
    last = build_reward(_spec({"type": "exact_match", "extract": "last_number"}))
    assert last.score(_sample("It is $1,200.")).correct is True
    boxed = build_reward(_spec({"type": "exact_match", "extract": "boxed"}))
    assert boxed.score(_sample("\\boxed{1200} and 5")).reward == 1.0


def test_math_verify_equivalence():
    fn = build_reward(_spec({"type": "math_verify"}))
    assert fn.score(_sample("so the result is $\\frac{1}{2}$", answer="#### 0.5")).reward == 1.0
    assert fn.score(_sample("\\boxed{\\frac{2}{4}}", answer="\\boxed{\\frac{1}{2}}")).correct is True
    assert fn.score(_sample("\\boxed{3}", answer="#### 4")).reward == 0.0


def test_reasoning_gym_reward_uses_task_scorer():
    spec = _spec(
        {"type": "reasoning_gym", "extract": "none"},
        dataset={"task": "spell_backward", "task_params": {"min_word_len": 3, "max_word_len": 4}, "size": 3},
    )
    ds = load_adapter_dataset(spec.dataset)
    row = ds.row(0)
    shared = build_reward(spec, ds)
    standalone = build_reward(spec)  # builds its own generator from the spec
    for fn in (shared, standalone):
        good = RewardSample("p", f"thinking... <answer>{row.answer}</answer>", row.answer, row.metadata)
        assert fn.score(good).reward == 1.0 and fn.score(good).correct
        assert fn.score(RewardSample("p", f" {row.answer} ", row.answer, row.metadata)).reward == 1.0
        assert fn.score(RewardSample("p", "<answer>zzzzzz</answer>", row.answer, row.metadata)).reward == 0.0


def test_format_reward_and_format_bonus():
    fmt = build_reward(_spec({"type": "format", "format_regex": r"<answer>.*</answer>"}))
    assert fmt.score(_sample("<answer>1</answer>")).reward == 1.0
    assert fmt.score(_sample("1")).reward == 0.0
    assert fmt.score(_sample("1")).correct is None
    bonus = build_reward(_spec({"type": "exact_match", "format_regex": "####", "format_weight": 0.25}))
    assert bonus.score(_sample("#### 1200")).reward == pytest.approx(1.25)
    assert bonus.score(_sample("1200")).reward == pytest.approx(1.0)
    assert bonus.score(_sample("#### 7")).reward == pytest.approx(0.25)


def test_overlong_penalty_applied_from_response_length():
    fn = build_reward(
        _spec({"type": "exact_match", "overlong_buffer_len": 4, "overlong_penalty_factor": 1.0})
    )
    # max_new_tokens 20, buffer 4: free up to 16 tokens
    assert fn.score(_sample("1200", response_length=16)).reward == pytest.approx(1.0)
    assert fn.score(_sample("1200", response_length=18)).reward == pytest.approx(0.5)
    assert fn.score(_sample("0", response_length=20)).reward == pytest.approx(-1.0)
    assert fn.score(_sample("1200")).reward == 1.0  # unknown length: no shaping
    assert fn.score(_sample("1200", response_length=9, max_new_tokens=10)).reward == pytest.approx(0.25)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "custom_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            import numpy as np

            def length_reward(prompt, completion, answer, metadata, scale=1.0):
                return np.float32(scale * len(completion))

            async def async_reward(prompt, completion, answer, metadata):
                await asyncio.sleep(0)
                return {"reward": float(completion == answer), "correct": completion == answer}

            def batch_reward(prompts, completions, answers, metadatas, bonus=0.0):
                return [float(c == a) + bonus for c, a in zip(completions, answers)]

            async def async_batch_reward(prompts, completions, answers, metadatas):
                return [m.get("w", 0.0) for m in metadatas]

            def wrong_count(prompts, completions, answers, metadatas):
                return [1.0]

            def not_a_number(prompt, completion, answer, metadata):
                return "high"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "custom_rewards_mod"
    sys.modules.pop("custom_rewards_mod", None)


def test_custom_rewards_sync_async_batched(custom_module):
    m = custom_module
    fn = build_reward(_spec({"type": f"{m}:length_reward", "kwargs": {"scale": 0.5}}))
    assert fn.score(_sample("abcd")).reward == 2.0
    fn = build_reward(_spec({"type": f"{m}:async_reward"}))
    out = fn.score(RewardSample("p", "x", "x"))
    assert (out.reward, out.correct) == (1.0, True)
    fn = build_reward(_spec({"type": f"{m}:batch_reward", "batched": True, "kwargs": {"bonus": 0.5}}))
    samples = [RewardSample("p", "a", "a"), RewardSample("p", "b", "a")]
    assert [o.reward for o in fn.score_batch(samples)] == [1.5, 0.5]
    fn = build_reward(_spec({"type": f"{m}:async_batch_reward", "batched": True}))
    assert [o.reward for o in fn.score_batch([RewardSample("p", "a", None, {"w": 0.3})])] == [0.3]
    with pytest.raises(ValueError, match="returned 1 values for 2"):
        build_reward(_spec({"type": f"{m}:wrong_count", "batched": True})).score_batch(samples)
    with pytest.raises(TypeError, match="must be a number"):
        build_reward(_spec({"type": f"{m}:not_a_number"})).score(samples[0])


def test_batched_function_without_batched_flag_names_the_setting(custom_module):
    fn = build_reward(_spec({"type": f"{custom_module}:batch_reward"}))  # batched, but declared per sample
    with pytest.raises(TypeError, match="reward.batched: true") as err:
        fn.score(RewardSample("p", "a", "a"))
    assert "fn(prompts, completions, answers, metadatas" in str(err.value)
