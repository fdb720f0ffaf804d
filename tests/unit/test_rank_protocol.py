"""The rank's primitives as one Protocol (``trainer/rank.py: RankPrimitives``): the real rank and the
fake one both provide every member, each method taking the Protocol's arguments."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from miles_multilora.models import compat
from miles_multilora.trainer.rank import RankPrimitives, TrainerRank
from tests.e2e.conftest import tiny_run_config
from tests.fake_rank import FakeRank


def _members() -> list[str]:
    return [n for n in vars(RankPrimitives) if not n.startswith("_")]


def _missing(rank: object) -> list[str]:
    """The Protocol's members ``rank`` lacks or whose method does not take the Protocol's arguments."""
    out = []
    for name in _members():
        want = vars(RankPrimitives)[name]
        if not hasattr(rank, name):
            out.append(name)
        elif inspect.isfunction(want):
            have = inspect.signature(getattr(rank, name)).parameters
            params = list(inspect.signature(want).parameters.values())[1:]  # past self
            extra = [p for n, p in have.items() if n not in {q.name for q in params}]
            if any(p.name not in have or have[p.name].kind != p.kind for p in params) or any(
                p.default is inspect.Parameter.empty for p in extra
            ):
                out.append(name)
    return out


def test_the_protocol_names_the_primitives_clients_call() -> None:
    assert {"sample", "forward_backward", "score", "optim_step", "save_slot", "gather"} <= set(_members())


def test_the_fake_rank_is_a_rank() -> None:
    assert _missing(FakeRank()) == []


@pytest.fixture
def cpu_dist():
    yield
    compat.destroy_distributed()


def test_the_trainer_rank_is_a_rank(tmp_path: Path, cpu_dist) -> None:
    assert _missing(TrainerRank(tiny_run_config(tmp_path, []))) == []
