"""A slot state saved at one expert-parallel size reads back at another: each EP rank gets its own
experts' tensors and moments (joined from the saved EP ranks' files), every rank the dense ones."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.errors import SpecError
from miles_multilora.trainer.shard import SlotMeta, read_shard, write_shard

EXPERTS = frozenset({"moe.lora_A", "moe.lora_B"})
META = SlotMeta("a", 2, 4.0, 0, 3, ("attn", "mlp"))


def _state(num_experts: int = 4) -> tuple[dict, dict]:
    """Every expert's tensors (``[E, ...]``), a dense layer's, and Adam moments of each."""
    g = torch.Generator().manual_seed(0)
    slot = {
        "moe.lora_A": torch.randn(num_experts, 2, 6, generator=g),
        "moe.lora_B": torch.randn(num_experts, 5, 2, generator=g),
        "moe.rank": torch.tensor(2),
        "attn.lora_A": torch.randn(2, 8, generator=g),
        "attn.lora_B": torch.randn(8, 2, generator=g),
    }
    moments = {n: torch.randn_like(t, dtype=torch.float32) for n, t in slot.items() if ".lora_" in n}
    return slot, {"step": 3, "exp_avg": moments, "exp_avg_sq": {n: t.abs() for n, t in moments.items()}}


def _local(state: tuple[dict, dict], rank: int, size: int) -> tuple[dict, dict]:
    """The state EP rank ``rank`` of ``size`` holds: its quarter, half or whole of the experts."""
    slot, optimizer = state
    n = slot["moe.lora_A"].shape[0] // size

    def cut(d: dict) -> dict:
        return {k: (t[rank * n : (rank + 1) * n] if k in EXPERTS else t) for k, t in d.items()}

    moments = {k: cut(optimizer[k]) for k in ("exp_avg", "exp_avg_sq")}
    return cut(slot), {"step": optimizer["step"], **moments}


def _save(directory, state, size: int) -> None:
    for rank in range(size):  # EP rank 0 also writes the TP shard (its dense tensors)
        slot, optimizer = _local(state, rank, size)
        write_shard(directory, 0, slot, optimizer, META, (rank, size), EXPERTS, (rank == 0, True))


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (1, 1)])
def test_a_state_saved_at_one_ep_size_loads_at_another(tmp_path, saved, loaded):
    state = _state()
    _save(tmp_path, state, saved)
    experts = [f"experts_ep{r}of{saved}.pt" for r in range(saved)] if saved > 1 else []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["slot_rank0.pt", *experts])
    for rank in range(loaded):
        read = read_shard(tmp_path, 0, (rank, loaded), EXPERTS)
        slot, optimizer = _local(state, rank, loaded)
        _equal(read["slot"], slot)
        _equal(read["optimizer"], optimizer)
        assert read["meta"]["version"] == 3


def test_experts_that_do_not_split_over_the_ranks_are_refused(tmp_path):
    _save(tmp_path, _state(num_experts=2), 2)
    with pytest.raises(SpecError, match="2 experts do not split over 4 EP ranks"):
        read_shard(tmp_path, 0, (0, 4), EXPERTS)
