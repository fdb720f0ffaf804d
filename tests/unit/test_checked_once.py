"""``checked_once``: the expert-parallel engine's isolation. Groups with a request the check refuses
get their error, the others go to one engine call, made even when no group is left (the EP ranks'
calls are collectives); an error of that call fails every group it carried, with no retry."""

from __future__ import annotations

from miles_multilora.rollout import GenerationRequest, RolloutError
from miles_multilora.rollout.isolation import checked_once


def _group(n: int, size: int = 2) -> list[GenerationRequest]:
    return [GenerationRequest.for_base([n, i + 1]) for i in range(size)]


def _refuse_prompts_starting_with(bad: int):  # noqa: ANN202
    def check(request: GenerationRequest, index: int) -> None:
        if request.prompt_ids[0] == bad:
            raise RolloutError(f"request {index}: refused")

    return check


def test_refused_groups_get_their_error_and_the_rest_one_call() -> None:
    calls: list[list[int]] = []

    def generate(groups):  # noqa: ANN001, ANN202
        calls.append([g[0].prompt_ids[0] for g in groups])
        return [[f"sample of {g[0].prompt_ids[0]}"] for g in groups]

    out = checked_once([_group(1), _group(2), _group(3)], generate, _refuse_prompts_starting_with(2))
    assert calls == [[1, 3]]
    assert out[0] == ["sample of 1"] and out[2] == ["sample of 3"]
    assert isinstance(out[1], RolloutError) and "refused" in str(out[1])


def test_the_call_is_made_without_groups_and_its_failure_fails_its_groups_only() -> None:
    calls: list[int] = []

    def empty(groups):  # noqa: ANN001, ANN202
        calls.append(len(groups))
        return []

    assert checked_once([], empty, _refuse_prompts_starting_with(0)) == []
    assert checked_once([_group(5)], empty, _refuse_prompts_starting_with(5))[0].args[0].endswith("refused")
    assert calls == [0, 0]  # joined even with nothing to generate

    def failing(groups):  # noqa: ANN001, ANN202
        calls.append(len(groups))
        raise ValueError("engine down")

    out = checked_once([_group(1), _group(2), _group(3)], failing, _refuse_prompts_starting_with(2))
    assert calls[-1] == 2  # one call, not split and retried
    assert [str(o) for o in out] == [
        "ValueError: engine down",
        "request 0: refused",
        "ValueError: engine down",
    ]
    assert all(isinstance(o, RolloutError) for o in out)
