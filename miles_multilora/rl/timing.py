"""Wall-clock seconds of a step's phases, each measured by a ``with timer.phase(name):`` block."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """``seconds``: ``<phase>_s`` for every phase run; ``total()``: since the timer was made."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"{name}_s"] = time.perf_counter() - start

    def total(self) -> float:
        return time.perf_counter() - self.started
