"""MultiLoRADataSource: interleaving, batch sizes, epochs, refill and exact resume."""

import json
from collections import Counter

import pytest

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data import MultiLoRADataSource
from miles_multilora.errors import ConfigError, SpecError


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "qa.jsonl"
    rows = [{"q": f"What is {i} plus {i}?", "a": str(2 * i), "topic": "add"} for i in range(11)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _spec(name, qa_file=None, **over):
    data = {"name": name, "num_steps": 100, "prompts_per_step": 3}
    if qa_file:
        data["dataset"] = {"path": qa_file, "prompt_key": "q", "answer_key": "a", "seed": 7}
    else:
        data["dataset"] = {
            "task": "basic_arithmetic",
            "task_params": {"min_terms": 2, "max_terms": 2},
            "size": 7,
        }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    if "num_epochs" in over:
        data.pop("num_steps")
    return parse_adapter_spec(data)


def _view(batch):
    return {name: [(it.uid, it.index, it.prompt, it.answer) for it in items] for name, items in batch.items()}


def _draw(source, k, names=None):
    return [_view(source.next_batch(names)) for _ in range(k)]


def test_round_robin_all_adapters_with_own_batch_sizes(qa_file):
    src = MultiLoRADataSource()
    src.add_adapter(_spec("a", qa_file, prompts_per_step=4))
    src.add_adapter(_spec("b", prompts_per_step=2))
    batch = src.next_batch()
    assert list(batch) == ["a", "b"]
    assert [len(batch["a"]), len(batch["b"])] == [4, 2]
    item = batch["a"][0]
    assert item.adapter == "a" and item.uid == "a:0:0"
    assert item.prompt == f"What is {int(item.answer) // 2} plus {int(item.answer) // 2}?"
    assert item.metadata == {"topic": "add"}
    assert batch["b"][0].metadata["entry"]["answer"] == batch["b"][0].answer


def test_round_robin_cycles_k_adapters_per_step_and_survives_removal(qa_file):
    src = MultiLoRADataSource(adapters_per_step=2)
    for name in "abc":
        src.add_adapter(_spec(name, qa_file))
    assert [list(src.next_batch()) for _ in range(3)] == [["a", "b"], ["a", "c"], ["b", "c"]]
    src.next_batch()  # a, b -> next starts at c
    src.remove_adapter("c")
    assert list(src.next_batch()) == ["a", "b"]
    assert list(src.next_batch(names=["b"])) == ["b"]


def test_weighted_policy_follows_weights(qa_file):
    src = MultiLoRADataSource(policy="weighted", seed=3)
    src.add_adapter(_spec("heavy", qa_file, num_steps=10_000, prompts_per_step=1), weight=9.0)
    src.add_adapter(_spec("light", qa_file, num_steps=10_000, prompts_per_step=1), weight=1.0)
    counts = Counter(name for _ in range(400) for name in src.next_batch())
    assert counts["heavy"] + counts["light"] == 400
    assert 0.8 < counts["heavy"] / 400 < 0.97


def test_epochs_shuffle_and_num_epochs_stop(qa_file):
    src = MultiLoRADataSource()
    src.add_adapter(_spec("a", qa_file, num_epochs=2, prompts_per_step=4))
    batches = []
    while not src.is_exhausted("a"):
        batches.append(src.next_batch()["a"])
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 2]  # 2 epochs x 11 rows, last batch short
    items = [it for b in batches for it in b]
    first, second = [it.index for it in items[:11]], [it.index for it in items[11:]]
    assert sorted(first) == sorted(second) == list(range(11))
    assert first != second != list(range(11))  # reshuffled every epoch
    assert [it.epoch for it in items] == [0] * 11 + [1] * 11
    assert src.epoch("a") == 2 and src.exhausted() == ["a"]
    assert src.next_batch() == {}


def test_no_shuffle_keeps_file_order(qa_file):
    src = MultiLoRADataSource()
    src.add_adapter(_spec("a", qa_file, dataset={"shuffle": False}))
    assert [it.index for it in src.next_batch()["a"]] == [0, 1, 2]


def test_refill_draws_more_from_the_same_adapter(qa_file):
    src = MultiLoRADataSource()
    src.add_adapter(_spec("a", qa_file))
    src.add_adapter(_spec("b"))
    ref = MultiLoRADataSource()
    ref.add_adapter(_spec("a", qa_file))
    expected = [it.uid for it in ref.refill("a", 8)]
    first = src.next_batch()["a"]
    more = src.refill("a", 5)
    assert [it.uid for it in first + more] == expected
    assert src.adapter_state("b")["offset"] == 3  # b untouched by a's refill


def test_resume_exactly_after_k_batches(qa_file):
    def build(policy):
        src = MultiLoRADataSource(
            policy=policy, adapters_per_step=1 if policy == "round_robin" else 2, seed=11
        )
        src.add_adapter(_spec("a", qa_file, prompts_per_step=4))
        src.add_adapter(_spec("b", num_epochs=3))
        src.add_adapter(_spec("c", qa_file, dataset={"seed": 1}, prompts_per_step=2), weight=3.0)
        return src

    for policy in ("round_robin", "weighted"):
        src = build(policy)
        _draw(src, 5)
        state = src.state_dict()
        expected = _draw(src, 8)
        fresh = MultiLoRADataSource(
            policy=policy, adapters_per_step=1 if policy == "round_robin" else 2, seed=99
        )
        fresh.load_state_dict(json.loads(json.dumps(state)))  # survives JSON
        assert _draw(fresh, 8) == expected
        assert fresh.names == ["a", "b", "c"]


def test_resume_after_adapters_added_and_removed(qa_file):
    src = MultiLoRADataSource(adapters_per_step=2)
    src.add_adapter(_spec("a", qa_file))
    src.add_adapter(_spec("b"))
    _draw(src, 3)
    src.add_adapter(_spec("c", qa_file, dataset={"seed": 5}))
    _draw(src, 2)
    src.remove_adapter("a")
    _draw(src, 1)
    state = src.state_dict()
    expected = _draw(src, 6)

    fresh = MultiLoRADataSource(adapters_per_step=2)
    fresh.add_adapter(_spec("a", qa_file))  # stale extra: removed by the load
    fresh.load_state_dict(state)
    assert fresh.names == ["b", "c"]
    assert _draw(fresh, 6) == expected


def test_per_adapter_state_roundtrip_is_independent_of_other_adapters(qa_file):
    src = MultiLoRADataSource()
    src.add_adapter(_spec("a", qa_file))
    src.add_adapter(_spec("b"))
    _draw(src, 5)
    saved = src.adapter_state("a")
    expected = [it.uid for it in src.refill("a", 9)]

    other = MultiLoRADataSource(adapters_per_step=1)
    other.add_adapter(_spec("z"))
    other.add_adapter(_spec("a", qa_file))
    other.restore_adapter_state("a", saved)
    got = [it.uid for it in other.refill("a", 9)]
    assert got == expected
    assert saved["epoch"] == 1 and saved["offset"] == 4  # 15 rows drawn from 11


def test_bad_state_and_duplicates_raise_and_change_nothing(qa_file):
    src = MultiLoRADataSource()
    src.add_adapter(_spec("a", qa_file))
    with pytest.raises(SpecError, match="already registered"):
        src.add_adapter(_spec("a"))
    _draw(src, 1)
    before = src.state_dict()
    bad = src.adapter_state("a") | {"size": 99}
    with pytest.raises(ConfigError, match="size"):
        src.restore_adapter_state("a", bad)
    broken = src.state_dict()
    broken["adapters"]["a"]["cursor"]["offset"] = 500
    with pytest.raises(ConfigError, match="out of range"):
        src.load_state_dict(broken)
    assert src.state_dict() == before
    with pytest.raises(KeyError, match="not registered"):
        src.next_batch(["nope"])
    with pytest.raises(ConfigError, match="data.policy"):
        MultiLoRADataSource(policy="random")
