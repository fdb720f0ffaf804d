"""Per-slot loss metrics kept on the device until read.

A loss's metrics (``{slot: {name: value}}``) are a few numbers per slot, computed on the GPU. Reading
them to the host makes the host wait for the GPU; once per micro-batch that drains the GPU's queue
at every micro-batch. :class:`DeviceMetrics` holds them as one device table and reads it when first
looked at; :func:`read_together` reads the tables of a whole call's micro-batches with one wait.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch


class DeviceMetrics(Mapping[int, dict[str, float]]):
    """``{slot: {name: value}}`` held as ``table`` ``[len(ids), len(names)]`` on the device."""

    def __init__(self, ids: list[int], names: list[str], table: torch.Tensor) -> None:
        self.ids, self.names, self.table = ids, names, table
        self._values: dict[int, dict[str, float]] | None = None

    @property
    def read(self) -> bool:
        return self._values is not None

    def fill(self, rows: list[list[float]]) -> None:
        """Take the table's values, read already (one list per slot)."""
        self._values = {
            s: dict(zip(self.names, row, strict=True)) for s, row in zip(self.ids, rows, strict=True)
        }
        self.table = None  # type: ignore[assignment]

    def _host(self) -> dict[int, dict[str, float]]:
        if self._values is None:
            read_together([self])
        assert self._values is not None
        return self._values

    def __getitem__(self, slot: int) -> dict[str, float]:
        return self._host()[slot]

    def __iter__(self) -> Iterator[int]:
        return iter(self._host())

    def __len__(self) -> int:
        return len(self.ids)


def read_together(items: Iterable[object]) -> None:
    """Read every unread :class:`DeviceMetrics` in ``items`` to the host with one wait."""
    pending = [m for m in items if isinstance(m, DeviceMetrics) and not m.read]
    if not pending:
        return
    flat = torch.cat([m.table.float().reshape(-1) for m in pending]).cpu().tolist()
    start = 0
    for m in pending:
        width = len(m.names)
        rows = [flat[start + i * width : start + (i + 1) * width] for i in range(len(m.ids))]
        start += width * len(m.ids)
        m.fill(rows)
