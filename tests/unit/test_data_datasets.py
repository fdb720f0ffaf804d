"""Dataset loading (local HF formats, reasoning-gym), prompt rendering and register-time validation."""

import json
import sys

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from miles_multilora.config.adapter import PromptSpec, parse_adapter_spec
from miles_multilora.data import load_adapter_dataset, render_prompt, validate_adapter_resources
from miles_multilora.data.datasets import is_hub_id
from miles_multilora.data.records import DatasetRow
from miles_multilora.errors import SpecError

ROWS = [{"problem": f"2 + {i} = ?", "solution": str(2 + i), "level": i % 3} for i in range(5)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    ds = datasets.Dataset.from_list(ROWS)
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    (root / "d.json").write_text(json.dumps(ROWS))
    ds.to_parquet(str(root / "d.parquet"))
    ds.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(str(root / "saved_dict"))
    arrow = next((root / "saved").glob("*.arrow"))
    return {
        "jsonl": str(root / "d.jsonl"),
        "json": str(root / "d.json"),
        "parquet": str(root / "d.parquet"),
        "saved": str(root / "saved"),
        "saved_dict": str(root / "saved_dict"),
        "arrow": str(arrow),
    }


def _spec(**over):
    data = {"name": "t", "num_steps": 1, "dataset": {"prompt_key": "problem", "answer_key": "solution"}}
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_adapter_spec(data)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "saved", "arrow"])
def test_local_formats_load_uniform_rows(files, fmt):
    ds = load_adapter_dataset(_spec(dataset={"path": files[fmt]}).dataset)
    assert len(ds) == 5
    row = ds.row(3)
    assert (row.prompt, row.answer, row.metadata) == ("2 + 3 = ?", "5", {"level": 0})


def test_saved_dataset_dict_picks_split(files):
    ds = load_adapter_dataset(_spec(dataset={"path": files["saved_dict"], "split": "test"}).dataset)
    assert len(ds) == 2
    with pytest.raises(SpecError, match="dataset.split"):
        load_adapter_dataset(_spec(dataset={"path": files["saved_dict"], "split": "dev"}).dataset)


def test_reasoning_gym_dataset_is_deterministic_and_scores():
    spec = _spec(
        dataset={
            "task": "basic_arithmetic",
            "task_params": {"max_terms": 2, "max_digits": 1},
            "size": 4,
            "seed": 3,
        }
    )
    a, b = load_adapter_dataset(spec.dataset), load_adapter_dataset(spec.dataset)
    assert len(a) == 4
    assert [a.row(i).prompt for i in range(4)] == [b.row(i).prompt for i in range(4)]
    row = a.row(2)
    assert row.metadata["task"] == "basic_arithmetic"
    assert a.score_answer(row.answer, row.metadata["entry"]) == 1.0
    assert a.score_answer("not a number", row.metadata["entry"]) == 0.0


def _tokenizer(with_template=True):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if with_template:
        hf.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    return hf


def test_render_prompt_template_system_and_chat_template():
    row = DatasetRow(prompt="2 + 2 = ?", answer="4", fields={"level": 1})
    spec = PromptSpec(template="Level {level}: {prompt}", system_prompt="Be brief.")
    assert render_prompt(row, spec, None) == "Be brief.\n\nLevel 1: 2 + 2 = ?"
    assert (
        render_prompt(row, spec, _tokenizer())
        == "<|system|>Be brief.\n<|user|>Level 1: 2 + 2 = ?\n<|assistant|>"
    )
    no_chat = PromptSpec(template="{prompt}", use_chat_template=False)
    assert render_prompt(row, no_chat, _tokenizer()) == "2 + 2 = ?"
    assert render_prompt(row, PromptSpec(), _tokenizer(with_template=False)) == "2 + 2 = ?"
    with pytest.raises(SpecError, match="prompt.template"):
        render_prompt(row, PromptSpec(template="{missing}"), None)


def test_validate_accepts_good_specs(files, tmp_path, monkeypatch):
    validate_adapter_resources(
        _spec(dataset={"path": files["jsonl"]}, prompt={"template": "Q ({level}): {prompt}"})
    )
    validate_adapter_resources(
        _spec(
            dataset={"task": "letter_counting", "task_params": {"min_words": 1, "max_words": 3}},
            reward={"type": "reasoning_gym"},
        )
    )
    (tmp_path / "my_reward_mod.py").write_text(
        "def score(prompt, completion, answer, metadata):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    validate_adapter_resources(
        _spec(dataset={"path": files["parquet"]}, reward={"type": "my_reward_mod:score"})
    )
    sys.modules.pop("my_reward_mod", None)


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"dataset": {"path": "/no/such/file.jsonl"}}, "dataset.path"),
        ({"dataset": {"path": "openai/gsm8k"}}, "dataset.path"),  # a hub id the (offline) tests cannot reach
        ({"dataset": {"path": "./missing_dir"}}, "dataset.path"),
        ({"dataset": {"path": "JSONL", "prompt_key": "question"}}, "dataset.prompt_key"),
        ({"dataset": {"path": "JSONL", "answer_key": "answer"}}, "dataset.answer_key"),
        ({"dataset": {"path": "JSONL"}, "prompt": {"template": "{prompt} {nope}"}}, "prompt.template"),
        ({"dataset": {"task": "no_such_task"}}, "dataset.task"),
        ({"dataset": {"task": "basic_arithmetic", "task_params": {"wings": 2}}}, "dataset.task_params"),
        ({"dataset": {"task": "basic_arithmetic", "task_params": {"size": 2}}}, "dataset.task_params"),
        ({"dataset": {"path": "JSONL"}, "reward": {"type": "reasoning_gym"}}, "reward.type"),
        ({"dataset": {"path": "JSONL"}, "reward": {"type": "nonexistent_mod_xyz:fn"}}, "reward.type"),
        ({"dataset": {"path": "JSONL"}, "reward": {"type": "json:no_such_function"}}, "reward.type"),
        ({"dataset": {"path": "JSONL"}, "reward": {"type": "fuzzy"}}, "reward.type"),
        ({"dataset": {"path": "JSONL"}, "reward": {"type": "format"}}, "reward.format_regex"),
        ({"dataset": {"path": "JSONL"}, "reward": {"format_regex": "(unclosed"}}, "reward.format_regex"),
        (
            {"dataset": {"path": "JSONL"}, "reward": {"overlong_buffer_len": 500}},
            "reward.overlong_buffer_len",
        ),
        ({"dataset": {"path": "JSONL"}, "reward": {"batched": True}}, "reward.batched"),
    ],
)
def test_validate_names_the_key(files, over, key):
    if over["dataset"].get("path") == "JSONL":
        over = {**over, "dataset": {**over["dataset"], "path": files["jsonl"]}}
    with pytest.raises(SpecError) as info:
        validate_adapter_resources(_spec(**over))
    assert info.value.key == key


def test_hub_id_shape():
    assert is_hub_id("gsm8k") and is_hub_id("openai/gsm8k")
    assert not is_hub_id("a/b/c") and not is_hub_id("data.jsonl") and not is_hub_id("/abs/dir")
