"""A parked slot comes back in a fixed number of batched copies, however many layers the model has,
and bit for bit as it was (tiny Megatron model, fp32 CPU, a real trainer rank; the operations are
counted with torch.profiler)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.models import compat
from miles_multilora.trainer import offload
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config

# Tensor operations that write memory. Views (select, slice, narrow) move no data and are not counted.
WRITES = ("aten::copy_", "aten::zero_", "aten::fill_", "aten::index_put_", "aten::_to_copy", "aten::clone")


def rank_with(tmp_path: Path, layers: int) -> TrainerRank:
    cfg = tiny_run_config(
        tmp_path / f"run{layers}",
        [],
        lora={"num_slots": 2, "max_rank": 8},
        model={"tiny": {"num_layers": layers}},
    )
    return TrainerRank(cfg)


def nll(mb):
    return -(mb.logprobs * mb.mask).sum(), {}


def trained_and_parked(rank: TrainerRank, adapter_rank: int) -> offload.ParkedSlot:
    """Slot 0 opened at ``adapter_rank``, two optimizer steps, one more backward not stepped
    (gradients to keep), parked and closed."""
    rank.open_slot(0, adapter_rank, 16.0, 7, OptimizerSpec(lr=1e-2), "a")
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    row = ScoredRow(slot=0, tokens=tokens, positions=list(range(len(tokens) - 1)))
    for _ in range(2):
        rank.forward_backward([row], nll)
        rank.optim_step([0])
    rank.forward_backward([row], nll)
    parked = offload.park(rank, 0)
    rank.close_slot(0)
    return parked


def snapshot(rank: TrainerRank, slot: int) -> dict[str, torch.Tensor]:
    """Every tensor row of ``slot`` and its Python-side settings (as tensors)."""
    out = {}
    opt = rank.optimizer
    for i, (name, p) in enumerate(zip(opt.names, opt.params, strict=True)):
        out[name] = p[slot].clone()
        out[f"{name}.grad"] = p.grad[slot].clone()
        out[f"{name}.m"] = opt.exp_avg[i][slot].clone()
        out[f"{name}.v"] = opt.exp_avg_sq[i][slot].clone()
        if opt.master[i] is not None:
            out[f"{name}.master"] = opt.master[i][slot].clone()
    for layer in multi_lora_layers(rank.model):
        out[f"{layer.key}.lora_scale"] = layer.lora_scale[slot].clone()
        out[f"{layer.key}.settings"] = torch.tensor([layer.slot_rank[slot], layer.slot_scale[slot]])
        shape = layer.peft_slot_shapes[slot]
        parts = [] if shape is None else [(p.start, p.end, p.alpha) for p in shape.parts if p is not None]
        out[f"{layer.key}.shape"] = torch.tensor(parts + [(-1, -1, -1.0)])  # the marker: never empty
    out["optimizer"] = torch.tensor([opt.steps[slot], opt.total_steps[slot] or -1, opt.specs[slot].lr])
    return out


def restore_writes(tmp_path: Path, layers: int, adapter_rank: int) -> tuple[Counter, int]:
    """Top-level writing operations of one restore, and the number of slot tensors restored."""
    rank = rank_with(tmp_path, layers)
    try:
        parked = trained_and_parked(rank, adapter_rank)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            offload.unpark(rank, parked, 1)
        top = Counter(
            e.name
            for e in prof.events()
            if e.cpu_parent is None and (e.name in WRITES or "_foreach_" in e.name)
        )
        return top, len(rank.optimizer.params)
    finally:
        compat.destroy_distributed()


@pytest.mark.parametrize("adapter_rank", [8, 4])  # the full max_rank, and cut to a lower rank (padded back)
def test_a_restore_is_a_few_batched_copies_whatever_the_layer_count(
    tmp_path: Path, adapter_rank: int
) -> None:
    small, tensors_small = restore_writes(tmp_path, 2, adapter_rank)
    large, tensors_large = restore_writes(tmp_path, 4, adapter_rank)
    assert tensors_large == 2 * tensors_small  # twice the slot tensors ...
    assert small == large  # ... the same operations
    assert not any(name in WRITES for name in large), large  # no per-tensor copy outside the batched calls
    assert 1 <= sum(large.values()) <= 8, large


@pytest.mark.parametrize("prefetch", [False, pytest.param(True, marks=pytest.mark.gpu)])
# trainer/slot_rows.py (cut blocks one by one, or in groups of a shape as on a GPU), or the saved-state tree
@pytest.mark.parametrize("packing", ["rows", "rows-grouped", "general"])
@pytest.mark.parametrize(
    ("adapter_rank", "targets"), [(8, None), (4, None), (4, ["attn"])]
)  # whole rows; cut to rank 4; and the MLP layers untrained (rank 0)
def test_the_batched_restore_is_bit_exact(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    adapter_rank: int,
    targets: list[str] | None,
    packing: str,
    prefetch: bool,
) -> None:
    """Also with its copy back to the GPU started before another adapter's step (``prefetch``)."""
    rank = rank_with(tmp_path, 2)
    if packing == "general":
        monkeypatch.setattr(rank.slot_rows, "row_blocks", lambda slot: None)
    rank.slot_rows.group_cut_blocks = {"rows": False, "rows-grouped": True}.get(packing)
    try:
        rank.open_slot(0, adapter_rank, 16.0, 7, OptimizerSpec(lr=1e-2), "a", targets=targets)
        tokens = [3, 14, 15, 92, 65, 35, 89, 79]
        row = ScoredRow(slot=0, tokens=tokens, positions=list(range(len(tokens) - 1)))
        for _ in range(2):
            rank.forward_backward([row], nll)
            rank.optim_step([0])
        rank.forward_backward([row], nll)
        before = snapshot(rank, 0)
        parked = offload.park(rank, 0)
        assert (parked.rows is not None) == (packing != "general")
        rank.close_slot(0)
        if prefetch:  # on its way back while the next step runs
            assert 0.9 * parked.nbytes < parked.prefetch() <= parked.nbytes  # its float tensors
            assert parked.staged is not None and parked.prefetch() == 0  # started once
        # slot 1 held someone else first: the restore must overwrite everything it had
        rank.open_slot(1, 8, 8.0, 3, OptimizerSpec(lr=1e-2), "b")
        rank.forward_backward([ScoredRow(slot=1, tokens=tokens, positions=[0, 1, 2])], nll)
        rank.optim_step([1])
        rank.close_slot(1)
        rank.forward_backward(
            [ScoredRow(slot=1, tokens=tokens, positions=[0])], nll
        )  # grads the restore replaces
        opened = offload.unpark(rank, parked, 1)
        after = snapshot(rank, 1)
        assert opened.version == 2
        assert rank.offload_stats["unpark_prefetched"] == prefetch and parked.staged is None
        for key, value in before.items():
            assert torch.equal(value, after[key]), key
        assert rank.optimizer.steps[1] == 2
    finally:
        compat.destroy_distributed()


def assert_same_tree(a: object, b: object, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where  # type: ignore[arg-type]
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")  # type: ignore[index]
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where  # type: ignore[union-attr]
    else:
        assert a == b, where


@pytest.mark.parametrize(("adapter_rank", "targets"), [(8, None), (4, None), (4, ["attn"])])
def test_a_park_as_rows_reads_back_as_the_general_park_s_tree(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    adapter_rank: int,
    targets: list[str] | None,
) -> None:
    """What a spill or any reader of a parked state sees does not depend on how it was packed."""
    rank = rank_with(tmp_path, 2)
    try:
        rank.open_slot(0, adapter_rank, 16.0, 7, OptimizerSpec(lr=1e-2), "a", targets=targets)
        tokens = [3, 14, 15, 92, 65, 35, 89, 79]
        row = ScoredRow(slot=0, tokens=tokens, positions=list(range(len(tokens) - 1)))
        rank.forward_backward([row], nll)
        rank.optim_step([0])
        rank.forward_backward([row], nll)  # gradients to keep
        rows = offload.park(rank, 0)
        monkeypatch.setattr(rank.slot_rows, "row_blocks", lambda slot: None)
        general = offload.park(rank, 0)
        assert rows.rows is not None and rows.saved is None and general.saved is not None
        expected, got = general.state(0), rows.state(0)
        # the general park drops each zero gradient, the row park keeps all when any is not zero:
        # the same slot either way (a gradient not held restores as zero)
        zeros = {n: g for n, g in got["grads"].items() if n not in expected["grads"]}
        assert all(not g.any() for g in zeros.values())
        assert_same_tree(
            expected, {**got, "grads": {n: g for n, g in got["grads"].items() if n not in zeros}}
        )
        assert rows.state(0)["grads"]
    finally:
        compat.destroy_distributed()


@pytest.mark.parametrize("adapter_rank", [8, 4])
def test_a_restore_zeroes_the_gradients_the_park_did_not_hold(tmp_path: Path, adapter_rank: int) -> None:
    rank = rank_with(tmp_path, 2)
    try:
        rank.open_slot(0, adapter_rank, 16.0, 7, OptimizerSpec(lr=1e-2), "a")
        tokens = [3, 14, 15, 92, 65, 35, 89, 79]
        rank.forward_backward([ScoredRow(slot=0, tokens=tokens, positions=[0, 1, 2])], nll)
        rank.optim_step([0])  # its gradients are spent: the park holds none
        parked = offload.park(rank, 0)
        assert not parked.state(0)["grads"]
        rank.close_slot(0)
        for p in rank.optimizer.params:  # stale gradient rows in the slot it goes to
            p.grad[1].fill_(1.0)
        offload.unpark(rank, parked, 1)
        assert not any(p.grad[1].any() for p in rank.optimizer.params)
    finally:
        compat.destroy_distributed()


def test_a_slot_restored_before_it_was_ever_parked_parks_after_other_slots_change(tmp_path: Path) -> None:
    """The restore caches its views of the slot (made without autograd); a new adapter opened in
    another slot writes the same tensors with autograd on. A park of the restored slot after that
    still reads its rows (it once failed: a view made in no-grad mode whose base changed in grad
    mode may not be read in grad mode)."""
    rank = rank_with(tmp_path, 2)
    try:
        parked = trained_and_parked(rank, 8)
        offload.unpark(rank, parked, 1)  # slot 1 never parked: its views are made here
        held = snapshot(rank, 1)
        rank.open_slot(0, 4, 8.0, 3, OptimizerSpec(lr=1e-2), "b")
        again = offload.park(rank, 1)
        rank.close_slot(1)
        offload.unpark(rank, again, 1)
        after = snapshot(rank, 1)
        assert all(torch.equal(held[k], after[k]) for k in held), [
            k for k in held if not torch.equal(held[k], after[k])
        ]
    finally:
        compat.destroy_distributed()


def test_a_state_that_does_not_fit_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    from miles_multilora.errors import ConfigError
    from miles_multilora.trainer.slot_write import write_slot_state

    rank = rank_with(tmp_path, 2)
    try:
        parked = trained_and_parked(rank, 4)
        rank.open_slot(1, 8, 8.0, 3, OptimizerSpec(lr=1e-2), "b")
        held = snapshot(rank, 1)  # gradients exist: the parked adapter's backward allocated them
        ranks = [list(layer.slot_rank) for layer in multi_lora_layers(rank.model)]
        saved = parked.state(0)
        name = rank.optimizer.names[0]
        layer = name.rsplit(".", 1)[0]
        too_wide = {
            **saved["optimizer"],
            "exp_avg": {**saved["optimizer"]["exp_avg"], name: torch.zeros(99, 99)},
        }
        no_layer = {k: v for k, v in saved["slot"].items() if not k.startswith(f"{layer}.")}
        cases = [
            (saved["slot"], too_wide, {}, f"optimizer_state.exp_avg.{name}"),
            (no_layer, saved["optimizer"], {}, "slot_state"),
            (saved["slot"], saved["optimizer"], {"nope.lora_A": torch.zeros(1)}, "grads"),
        ]
        for tensors, optim, grads, key in cases:
            with pytest.raises(ConfigError) as err:
                write_slot_state(rank.model, rank.optimizer, 1, tensors, optim, grads)
            assert err.value.key == key
            after = snapshot(rank, 1)
            for k, v in held.items():
                assert torch.equal(v, after[k]), k
        assert rank.optimizer.steps[1] == 0 and rank.slot(1).name == "b"
        assert [list(layer.slot_rank) for layer in multi_lora_layers(rank.model)] == ranks
    finally:
        compat.destroy_distributed()
