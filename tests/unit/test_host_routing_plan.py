"""A training micro-batch's routing plan built from the host's row slots equals the plan built from
the slot-id tensor (which reads counts back from the device), for any mix of slots and base-only
rows; bad slots are refused as before. And per-slot loss metrics read together equal those read one
by one."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.algo.device_metrics import DeviceMetrics, read_together
from miles_multilora.errors import ConfigError
from miles_multilora.lora.routing import build_routing_plan, row_routing_plan

MIXES = {
    "mixed": [3, -1, 0, 4, 0, 1, 3, 3, -1, 2],
    "one-slot": [2, 2, 2],
    "base-only": [-1, -1],
    "single-row": [4],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seq", [1, 7])
def test_the_host_plan_equals_the_device_counted_plan(mix: str, seq: int) -> None:
    slots = MIXES[mix]
    ids = torch.tensor(slots).view(-1, 1).expand(-1, seq).contiguous()
    want = build_routing_plan(ids, 5)
    got = row_routing_plan(slots, seq, 5, "cpu")
    assert (got.batch, got.seq, got.counts, got.num_routed) == (
        want.batch,
        want.seq,
        want.counts,
        want.num_routed,
    )
    assert torch.equal(got.order, want.order)
    assert torch.equal(got.sorted_slots, want.sorted_slots)
    assert torch.equal(got.offsets, want.offsets)
    assert want.seq_slots is not None and torch.equal(got.seq_slots, want.seq_slots)
    assert got.segments() == want.segments()


@pytest.mark.parametrize(
    ("slots", "seq", "match"), [([0, 5], 3, "slot 5"), ([-2], 3, "slot -2"), ([], 3, "empty")]
)
def test_bad_row_slots_are_refused(slots: list[int], seq: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        row_routing_plan(slots, seq, 5, "cpu")


def test_metrics_read_together_equal_metrics_read_alone() -> None:
    tables = [torch.arange(6.0).view(2, 3) + i for i in range(3)]
    alone = [dict(DeviceMetrics([1, 4], ["a", "b", "c"], t.clone())) for t in tables]
    together = [DeviceMetrics([1, 4], ["a", "b", "c"], t.clone()) for t in tables]
    read_together(together)
    assert all(m.read for m in together)
    assert [dict(m) for m in together] == alone
    assert alone[2] == {1: {"a": 2.0, "b": 3.0, "c": 4.0}, 4: {"a": 5.0, "b": 6.0, "c": 7.0}}
