"""A trainer at TP=2 x EP=2 (x DP=2: 4 ranks, gloo, fp32) trains as one rank at TP=1 x EP=1.

On the tiny Qwen3-MoE checkpoint of ``test_trainer_ep`` (4 experts, the same weights at every layout),
two slots with different rows run two ``forward_backward`` + ``optim_step`` rounds on both layouts:
the rows' logprobs (the forward), the per-slot losses, every LoRA gradient the optimizer steps on
(dense ones gathered over TP, the experts' over EP: after the trainer's DP and expert-DP sums), the
per-slot grad norms and the exported PEFT adapters (every expert, gathered) agree within a stated
fp32 tolerance. Expert DP here is dp * tp / ep = 2 ranks: the replicas of an EP rank's experts
route other tokens (the other TP rank's share, the other DP rank's rows), so a gradient not summed
over that group shows. Each layout's state saved after the first round loads at the other (the TP
shards re-split, the experts re-split over EP): the weights exactly, and the optimizer's moments
so that the second round from the loaded state equals the second round of the layout that saved it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.test_moe_ep import _grads
from tests.distributed.test_trainer_ep import _adapter, _loss, _open, checkpoint  # noqa: F401 - a fixture
from tests.helpers import assert_close_at_scale, run_distributed

ROWS = [(0, 9), (1, 6), (0, 7), (1, 11), (0, 5)]  # (slot, length): an odd number of rows and tokens
REL = 1e-5  # fp32: the same sums in another order (TP splits, other micro-batches, all-reduces)
REL_ADAM = 1e-3  # exported weights after Adam steps, whose first step is ~lr * sign(grad) (test_lora_tp)


def _config(out: Path, hf: str, tp: int, ep: int, world: int):  # noqa: ANN202 - a RunConfig
    from tests.e2e.conftest import tiny_run_config

    return tiny_run_config(
        out / "run", [], model={"source": "hf", "hf_path": hf, "tp": tp, "ep": ep, "dp": world // tp},
        trainer={"micro_batch_size": 2, "world_size": world}, lora={"num_slots": 2, "max_rank": 4},
    )  # fmt: skip


def _rows() -> list:
    from miles_multilora.trainer.primitives import ScoredRow

    gen = torch.Generator().manual_seed(3)
    return [
        ScoredRow(slot, torch.randint(2, 60, (n,), generator=gen).tolist(), list(range(n - 1)), group=i)
        for i, (slot, n) in enumerate(ROWS)
    ]


def _round(trainer, record: dict) -> None:  # noqa: ANN001
    """One forward_backward + optim_step of both slots; the optimizer's inputs (every slot's full
    gradients, after the trainer's sums) caught on their way in."""
    step = trainer.optimizer.step

    def spy(active):  # noqa: ANN001, ANN202
        record.setdefault("grads", []).append(_grads(trainer.model))
        return step(active)

    trainer.optimizer.step = spy
    try:
        result = trainer.forward_backward(_rows(), _loss)
        stats = trainer.optim_step([0, 1])
    finally:
        trainer.optimizer.step = step
    record.setdefault("logprobs", []).append(result.logprobs)
    record.setdefault("losses", []).append({s: m["loss"] for s, m in result.per_slot.items()})
    record.setdefault("norms", []).append({s: st.grad_norm for s, st in stats.items()})


def _train(trainer, out: Path, load_from: Path | None) -> dict:  # noqa: ANN001
    """Two rounds (state saved and adapters exported after the first: ``state{s}``, ``slot{s}``;
    after the second: ``next{s}``); with ``load_from``, that layout's first-round state loaded
    (``loaded{s}``) and stepped once more (``from_other{s}``)."""
    record: dict = {}
    for slot in (0, 1):
        _open(trainer, slot)
    _round(trainer, record)
    for slot in (0, 1):
        trainer.export_peft(slot, out / f"slot{slot}")
        trainer.save_slot(slot, out / f"state{slot}")
    _round(trainer, record)
    for slot in (0, 1):
        trainer.export_peft(slot, out / f"next{slot}")
    if load_from is not None:
        for slot in (0, 1):
            trainer.close_slot(slot)
            _open(trainer, slot, restore=load_from / f"state{slot}")
            trainer.export_peft(slot, out / f"loaded{slot}")
        _round(trainer, {})
        for slot in (0, 1):
            trainer.export_peft(slot, out / f"from_other{slot}")
    return record


def _job(rank: int, world: int, out: str, hf: str, load_from: str) -> None:
    from miles_multilora.trainer.rank import TrainerRank

    torch.set_num_threads(1)
    trainer = TrainerRank(_config(Path(out), hf, 2, 2, world), rank, world)
    layout = trainer.layout
    assert (layout.dp_size, layout.ep_size, trainer.cfg.model.tp) == (2, 2, 2)
    record = _train(trainer, Path(out), Path(load_from))
    if rank == 0:
        torch.save(record, Path(out) / "result.pt")


def _one_rank(out: Path, hf: str, load_from: Path | None = None) -> dict:
    """TP=1 x EP=1 on this process (one rank)."""
    from miles_multilora.models import compat
    from miles_multilora.trainer.rank import TrainerRank

    out.mkdir()
    trainer = TrainerRank(_config(out, hf, 1, 1, 1))
    try:
        return _train(trainer, out, load_from)
    finally:
        compat.destroy_distributed()


def _assert_same_adapters(a: Path, b: Path, rel: float | None) -> None:
    """The PEFT adapters in ``a`` and ``b``: equal (``rel`` None) or within ``rel`` at scale."""
    w1, w2 = _adapter(a), _adapter(b)
    assert w1.keys() == w2.keys() and any(".experts.3." in k for k in w1), (a, b)
    for key in w1:
        if rel is None:
            assert torch.equal(w2[key], w1[key]), key
        else:
            assert_close_at_scale(w2[key], w1[key], rel, key)


@pytest.mark.slow
def test_tp2_ep2_trains_as_tp1_ep1_and_their_states_load_at_either(tmp_path, checkpoint):  # noqa: F811
    one_dir, four_dir = tmp_path / "tp1ep1", tmp_path / "tp2ep2"
    one = _one_rank(one_dir, str(checkpoint))
    four_dir.mkdir()
    run_distributed(_job, 4, (str(four_dir), str(checkpoint), str(one_dir)))
    four = torch.load(four_dir / "result.pt")
    for step in range(2):
        for a, b in zip(one["logprobs"][step], four["logprobs"][step], strict=True):
            assert_close_at_scale(torch.tensor(b), torch.tensor(a), REL, "logprobs")
        for slot in (0, 1):
            assert four["losses"][step][slot] == pytest.approx(one["losses"][step][slot], rel=REL)
            assert four["norms"][step][slot] == pytest.approx(one["norms"][step][slot], rel=REL)
        grads_one, grads_four = one["grads"][step], four["grads"][step]
        assert grads_one.keys() == grads_four.keys()
        experts = [k for k in grads_one if ".experts." in k and k.endswith("lora_B")]
        assert experts and all(grads_one[k].abs().sum() > 0 for k in experts)
        for key, grad in grads_one.items():
            assert_close_at_scale(grads_four[key], grad, REL, f"step {step}: {key}")
    assert one["norms"][1][0] > 0.05  # slot 0 is clipped
    for slot in (0, 1):
        _assert_same_adapters(one_dir / f"slot{slot}", four_dir / f"slot{slot}", REL_ADAM)
        _assert_same_adapters(one_dir / f"next{slot}", four_dir / f"next{slot}", REL_ADAM)
        # TP=1 x EP=1's state at TP=2 x EP=2: its weights exactly, its moments step on as it would
        _assert_same_adapters(one_dir / f"slot{slot}", four_dir / f"loaded{slot}", None)
        _assert_same_adapters(one_dir / f"next{slot}", four_dir / f"from_other{slot}", REL_ADAM)
    assert {p.name for p in (four_dir / "state0").iterdir()} == {
        "slot_rank0.pt", "slot_rank1.pt", "experts_ep0of2.pt", "experts_ep1of2.pt"
    }  # fmt: skip
    back = tmp_path / "back"  # and the reverse: TP=2 x EP=2's state at TP=1 x EP=1
    _one_rank(back, str(checkpoint), load_from=four_dir)
    for slot in (0, 1):
        _assert_same_adapters(four_dir / f"slot{slot}", back / f"loaded{slot}", None)
        _assert_same_adapters(four_dir / f"next{slot}", back / f"from_other{slot}", REL_ADAM)
