"""Continuous rollout over two DP ranks (fp32 CPU, gloo): each rank generates and carries its own
groups, the ranks agree on which adapters step, and both train every drawn prompt exactly once, in
order, within the staleness bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_distributed

STEPS = 3


def _steps(rank: int, world: int, out: str) -> None:
    from miles_multilora.rl import RLStep
    from tests.e2e.conftest import snapshot_of, tiny_run_config, toy_adapter
    from tests.e2e.test_continuous_rollout import record_trained

    specs = [
        toy_adapter("a", "fraction_of_lowercase", steps=STEPS, prompts_per_step=3),
        toy_adapter(
            "b", "fraction_of_digits", steps=STEPS, batched=True, seed=7, sampling={"max_new_tokens": 24}
        ),
    ]
    cfg = tiny_run_config(
        Path(out) / "run",
        specs,
        rollout={"max_staleness": 1, "max_batch_size": 8},
        trainer={"micro_batch_size": 3, "world_size": world},
    )
    worker = RLStep.build(cfg, rank, world)
    assert worker.continuous is not None
    trained = record_trained(worker)
    owned: list[tuple[int, int]] = []  # (owner, engine ids here) of every group drawn
    draw = worker.continuous.draw

    def recording_draw(names: Any, failures: Any) -> None:
        before = {id(c) for line in worker.continuous.carried.values() for c in line}
        draw(names, failures)
        for line in worker.continuous.carried.values():
            owned.extend((c.owner, len(c.ids)) for c in line if id(c) not in before)

    worker.continuous.draw = recording_draw  # type: ignore[method-assign]
    stepped = []
    for i in range(6 * STEPS):
        if all(n in worker.residents and worker.version(n) >= STEPS for n in ("a", "b")):
            break
        result = worker.step(snapshot_of(i + 1, specs, worker.versions(), init=i == 0))
        assert not result.failed, result.failed
        stepped.append(sorted(result.results))
    torch.save(
        {"trained": trained, "owned": owned, "stepped": stepped, "versions": worker.versions()},
        Path(out) / f"rank{rank}.pt",
    )


def test_two_dp_ranks_carry_their_own_groups_and_agree(tmp_path: Path) -> None:
    run_distributed(_steps, world_size=2, args=(str(tmp_path),))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["versions"] == ranks[1]["versions"] == {"a": STEPS, "b": STEPS}
    assert ranks[0]["stepped"] == ranks[1]["stepped"]  # the same adapters stepped at every step
    assert ranks[0]["trained"] == ranks[1]["trained"]  # every rank saw every group's samples
    for name, per_step in (("a", 3), ("b", 2)):
        uids = [uid for a, _, uid, _ in ranks[0]["trained"] if a == name]
        assert [int(u.rsplit(":", 1)[1]) for u in uids] == list(range(per_step * STEPS))
    ages = [version - v for _, version, _, vs in ranks[0]["trained"] for v in vs]
    assert 0 <= min(ages) and max(ages) <= 1
    for r, data in enumerate(ranks):  # each rank generated its own share only
        assert {n > 0 for owner, n in data["owned"] if owner == r} == {True}
        assert {n for owner, n in data["owned"] if owner != r} == {0}
    assert {owner for owner, _ in ranks[0]["owned"]} == {0, 1}


def _refused_on_rank0(rank: int, world: int, out: str) -> None:
    from dataclasses import replace

    from miles_multilora.rl import RLStep
    from tests.e2e.conftest import snapshot_of, tiny_run_config, toy_adapter

    specs = [
        toy_adapter(name, "fraction_of_digits", steps=1, batched=True, sampling={"max_new_tokens": 6})
        for name in "ab"
    ]
    cfg = tiny_run_config(
        Path(out) / "run", specs, rollout={"max_staleness": 1, "max_batch_size": 8},
        trainer={"micro_batch_size": 3, "world_size": world},
    )  # fmt: skip
    worker = RLStep.build(cfg, rank, world)
    assert worker.continuous is not None
    stream = worker.continuous.stream
    submit, calls = stream.submit, []

    def corrupting(groups: Any) -> Any:  # the session's first group ("a"'s, DP rank 0's): a token
        if not calls:  # outside the vocabulary, which only its owner's engine checks
            first = groups[0]
            groups = [[replace(first[0], prompt_ids=[10**6]), *first[1:]], *groups[1:]]
        calls.append(len(groups))
        return submit(groups)

    stream.submit = corrupting  # type: ignore[method-assign]
    failed = [worker.step(snapshot_of(1, specs, init=True)).failed]
    for i in range(1, 4):  # "b" trains on
        if worker.version("b") >= 1:
            break
        failed.append(worker.step(snapshot_of(i + 1, specs[1:], worker.versions(), init=False)).failed)
    torch.save({"failed": failed, "versions": worker.versions()}, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow  # ~35 s on 2 CPU cores
def test_a_group_refused_on_one_rank_fails_its_adapter_on_every_rank(tmp_path: Path) -> None:
    """A stream submit the owner's engine refuses in part fails that group's adapter on both DP ranks
    (agreed), and the other adapter steps; without the agreement one rank raised and its peer waited."""
    run_distributed(_refused_on_rank0, world_size=2, args=(str(tmp_path),), timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for data in ranks:
        first, *later = data["failed"]
        assert set(first) == {"a"} and "prompt token ids" in first["a"], first
        assert not any(later), later
    assert ranks[0]["versions"] == ranks[1]["versions"] == {"b": 1}
