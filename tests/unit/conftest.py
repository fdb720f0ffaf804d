"""Fixtures shared by the unit tests (a test module's own fixture of the same name wins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[object]:
    """A Tinker backend over a real trainer rank of the tiny model: 2 slots, rank <= 8."""
    from miles_multilora.models import compat
    from miles_multilora.tinker.backend import TinkerBackend
    from miles_multilora.trainer.rank import TrainerRank
    from tests.e2e.conftest import tiny_run_config

    cfg = tiny_run_config(
        tmp_path / "run", [], lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 4}
    )
    try:
        yield TinkerBackend(TrainerRank(cfg))
    finally:
        compat.destroy_distributed()
