"""DAPO dynamic sampling: all-equal groups are dropped, refilled per adapter, bounded by a round limit."""

from dataclasses import dataclass

from miles_multilora.algo import dynamic_sampling, is_informative


@dataclass
class Group:
    uid: str
    rewards: list[float]


def test_is_informative():
    assert is_informative([0.0, 1.0])
    assert not is_informative([1.0, 1.0, 1.0])
    assert not is_informative([0.5])


def test_drops_and_refills_per_adapter_until_target():
    first = {
        "a": [Group("a0", [1, 1]), Group("a1", [0, 1]), Group("a2", [0, 0])],
        "b": [Group("b0", [0, 1]), Group("b1", [1, 0])],
    }
    scripted = {"a": [[Group("a3", [1, 1]), Group("a4", [0, 1])], [Group("a5", [1, 0]), Group("a6", [0, 1])]]}
    asks = []

    def generate(wanted):
        asks.append(dict(wanted))
        return {name: scripted[name].pop(0) for name in wanted}

    res = dynamic_sampling(first, {"a": 3, "b": 2}, generate, max_refill_rounds=5)
    assert asks == [{"a": 2}, {"a": 1}]  # b already full; a asks only for what is missing
    assert [g.uid for g in res.groups["a"]] == ["a1", "a4", "a5"]  # a6 is beyond the target
    assert [g.uid for g in res.groups["b"]] == ["b0", "b1"]
    assert res.rounds == 2
    assert res.dropped == {"a": 3}
    assert res.generated == {"a": 7, "b": 2}
    assert res.short == {}
    assert res.metrics("a")["dynamic_sampling/drop_frac"] == 3 / 7


def test_stops_at_round_limit():
    calls = []

    def generate(wanted):
        calls.append(wanted)
        return {name: [Group(f"{name}{len(calls)}", [1.0, 1.0])] * k for name, k in wanted.items()}

    res = dynamic_sampling({"a": [Group("a0", [0.0, 0.0])]}, {"a": 1}, generate, max_refill_rounds=3)
    assert len(calls) == 3
    assert res.groups["a"] == []
    assert res.short == {"a": 1}
    assert res.rounds == 3


def test_zero_rounds_only_filters():
    res = dynamic_sampling({"a": [Group("a0", [0, 0]), Group("a1", [0, 1])]}, {"a": 2}, lambda w: 1 / 0, 0)
    assert [g.uid for g in res.groups["a"]] == ["a1"]
    assert res.short == {"a": 1}


def test_adapter_whose_data_ran_out_is_not_asked_again():
    calls = []

    def generate(wanted):
        calls.append(dict(wanted))
        return {"b": [Group("b", [0, 1])]} if "b" in wanted else {}

    res = dynamic_sampling(
        {"a": [Group("a0", [0, 0])], "b": [Group("b0", [1, 1]), Group("b1", [1, 1])]},
        {"a": 1, "b": 2},
        generate,
        max_refill_rounds=4,
    )
    assert calls[0] == {"a": 1, "b": 2}
    assert all("a" not in c for c in calls[1:])
    assert len(res.groups["b"]) == 2
    assert res.short == {"a": 1}
