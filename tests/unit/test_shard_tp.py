"""A slot state saved at one tensor-parallel size reads back at another (and at another EP size with
it): each TP rank gets its part of the full tensors, joined from the saved TP shards, the optimizer's
moments alike; a gated fc1's ``[gate; up]`` halves split each; replicated tensors pass as saved."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.errors import SpecError
from miles_multilora.trainer.shard import SlotMeta, read_shard, write_shard
from miles_multilora.trainer.tp_reshard import TPSplit

META = SlotMeta("a", 2, 4.0, 0, 3, ("attn", "mlp"))
EXPERTS = frozenset({"moe.lora_B"})
DIMS = {"proj.lora_A": (-1, False), "qkv.lora_B": (-2, False), "fc1.lora_B": (-2, True)}


def _full() -> dict[str, torch.Tensor]:
    """The whole tensors: a row layer's A, column layers' B (fc1 gated), replicated A/B, experts."""
    g = torch.Generator().manual_seed(0)
    return {
        "proj.lora_A": torch.randn(2, 8, generator=g),
        "proj.lora_B": torch.randn(6, 2, generator=g),
        "qkv.lora_A": torch.randn(2, 6, generator=g),
        "qkv.lora_B": torch.randn(12, 2, generator=g),
        "fc1.lora_B": torch.randn(8, 2, generator=g),  # [gate 4; up 4]
        "moe.lora_B": torch.randn(4, 5, 2, generator=g),
        "proj.rank": torch.tensor(2),
    }


def _part(name: str, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s part, written out by hand for each layout."""
    if name == "proj.lora_A":
        return t[:, rank * 8 // size : (rank + 1) * 8 // size]
    if name == "qkv.lora_B":
        return t[rank * 12 // size : (rank + 1) * 12 // size]
    if name == "fc1.lora_B":
        n = 4 // size
        return torch.cat([t[rank * n : (rank + 1) * n], t[4 + rank * n : 4 + (rank + 1) * n]])
    return t


def _shard(full: dict, tp: tuple[int, int], ep: tuple[int, int]) -> dict:
    out = {k: _part(k, t, *tp) for k, t in full.items()}
    n = 4 // ep[1]
    out["moe.lora_B"] = full["moe.lora_B"][ep[0] * n : (ep[0] + 1) * n]
    return out


def _save(directory, slot: dict, moments: dict, tp: int, ep: int) -> None:
    """What the ranks of a TP x EP layout write: each TP rank's shard, each EP rank's experts (the
    EP ranks are the TP ranks here, as Megatron lays out TP=2 x EP=2)."""
    for rank in range(max(tp, ep)):
        t, e = (rank % tp, tp), (rank % ep, ep)
        optimizer = {"step": 3, "exp_avg": _shard(moments, t, e)}
        write_shard(
            directory, t[0], _shard(slot, t, e), optimizer, META, e, EXPERTS if ep > 1 else frozenset()
        )


@pytest.mark.parametrize(
    ("saved", "loaded"), [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (4, 2)), ((4, 4), (2, 1))]
)
def test_a_state_saved_at_one_tp_and_ep_size_loads_at_another(tmp_path, saved, loaded):
    slot = _full()
    moments = {k: v * 10 for k, v in slot.items() if ".lora_" in k}
    _save(tmp_path, slot, moments, *saved)
    for rank in range(max(loaded)):
        tp, ep = (rank % loaded[0], loaded[0]), (rank % loaded[1], loaded[1])
        read = read_shard(tmp_path, tp[0], ep, EXPERTS, TPSplit(loaded[0], DIMS))
        want, want_moments = _shard(slot, tp, ep), _shard(moments, tp, ep)
        assert (
            read["slot"].keys() == want.keys() and read["optimizer"]["exp_avg"].keys() == want_moments.keys()
        )
        for name, t in want.items():
            assert torch.equal(read["slot"][name], t), (saved, loaded, rank, name)
            if name in want_moments:
                assert torch.equal(read["optimizer"]["exp_avg"][name], want_moments[name]), name
        assert read["optimizer"]["step"] == 3 and read["meta"]["version"] == 3


def test_tensors_that_do_not_split_over_the_tp_ranks_are_refused(tmp_path):
    full = _full()
    _save(tmp_path, full, full, 1, 1)
    with pytest.raises(SpecError, match=r"qkv.lora_B of shape \(12, 2\) does not split over 8 TP ranks"):
        read_shard(tmp_path, 0, tp=TPSplit(8, DIMS))
