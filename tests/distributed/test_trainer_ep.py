"""A trainer rank with expert parallelism (``model.ep``) trains as without it (fp32 CPU, gloo, 2 ranks).

Two slots with different rows on a tiny Qwen3-MoE checkpoint (4 experts; its weights are the same
at every layout, read by megatron-bridge): two ``forward_backward`` + ``optim_step`` rounds
at DP=2 x EP=2 give the losses, per-slot grad norms, scores and exported adapters (every expert,
gathered) of DP=2 x EP=1; the states each saves load at the other EP size, and adapters parked
(spilled) and restored into other slots at either size come back exactly. One row per micro-batch and an odd number of rows: the DP ranks run
different numbers of micro-batches, so the EP ranks' token exchange needs the lockstep fillers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close_at_scale, run_distributed

ROWS = [(0, 9), (1, 6), (0, 7), (1, 11), (0, 5)]  # (slot, length): 5 rows, one per micro-batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE checkpoint with a word-level tokenizer of its vocabulary (token i is "i")."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from tests.moe_helpers import make_tiny_moe_checkpoint

    root = make_tiny_moe_checkpoint(tmp_path_factory.mktemp("ep") / "hf", "qwen3_moe", seed=0)
    vocab = AutoConfig.from_pretrained(root).vocab_size
    words = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1").save_pretrained(root)
    return root


def _loss(batch):  # noqa: ANN001, ANN202 - a LossFn: each slot's summed token NLL, slot 1 weighted 2x
    weights = torch.tensor([1.0 + r.slot for r in batch.rows]).unsqueeze(1)
    nll = -(batch.logprobs * batch.mask * weights.to(batch.mask))
    metrics = {}
    for i, r in enumerate(batch.rows):
        m = metrics.setdefault(r.slot, {"num_tokens": 0.0, "loss": 0.0})
        m["num_tokens"] += float(batch.mask[i].sum())
        m["loss"] += float(nll[i].sum().detach())
    return nll.sum(), metrics


SLOTS = {0: (4, 8.0, 1, {"lr": 1e-2, "clip_grad": 0.05}), 1: (2, 4.0, 2, {"lr": 2e-2, "clip_grad": 0.0})}


def _config(out: Path, hf: str, ep: int, world: int):  # noqa: ANN202 - a RunConfig
    from tests.e2e.conftest import tiny_run_config

    return tiny_run_config(
        out / "run", [], model={"source": "hf", "hf_path": hf, "ep": ep, "dp": world},
        trainer={"micro_batch_size": 1, "world_size": world}, lora={"num_slots": 2, "max_rank": 4},
    )  # fmt: skip


def _open(trainer, slot: int, restore: Path | None = None) -> None:  # noqa: ANN001
    from miles_multilora.config.adapter import OptimizerSpec

    rank, alpha, seed, spec = SLOTS[slot]
    trainer.open_slot(slot, rank, alpha, seed, OptimizerSpec(**spec), "ab"[slot], restore=restore)


def _turns(trainer, out: Path, rank: int) -> None:  # noqa: ANN001
    """Both adapters reopened from their saved states, parked (spilled to disk: no host memory) and
    restored into each other's slots, then exported (``turn{slot}``)."""
    from miles_multilora.config.adapter import OptimizerSpec
    from miles_multilora.trainer.residency import Residency

    torch.distributed.barrier()  # every saved state written (by its writers) before it is read
    residency = Residency(trainer, host_bytes=0, spill_dir=out / f"spill{rank}", prefetch_bytes=0)
    for slot in (0, 1):
        trainer.close_slot(slot)
        lora_rank, alpha, seed, spec = SLOTS[slot]
        residency.open(
            "ab"[slot], slot, lora_rank, alpha, seed, OptimizerSpec(**spec), restore=out / f"state{slot}"
        )
    for name in "ab":
        residency.park(name)
    assert residency.stats["spilled"] == 2 and not trainer.slots
    for slot in (0, 1):
        residency.restore("ab"[slot], 1 - slot)
        trainer.export_peft(1 - slot, out / f"turn{slot}")


def _job(rank: int, world: int, ep: int, out: str, hf: str, load_from: str | None) -> None:
    from miles_multilora.trainer.primitives import ScoredRow
    from miles_multilora.trainer.rank import TrainerRank

    torch.set_num_threads(1)
    trainer = TrainerRank(_config(Path(out), hf, ep, world), rank, world)
    assert trainer.layout.ep_size == ep and trainer.layout.dp_size == 2
    for slot in (0, 1):
        _open(trainer, slot)
    gen = torch.Generator().manual_seed(3)
    rows = [
        ScoredRow(slot, torch.randint(2, 60, (n,), generator=gen).tolist(), list(range(n - 1)), group=i)
        for i, (slot, n) in enumerate(ROWS)
    ]
    losses, norms = [], []
    for _ in range(2):  # B = 0 at first: the second step moves A too
        result = trainer.forward_backward(rows, _loss)
        losses.append({s: m["loss"] for s, m in result.per_slot.items()})
        norms.append({s: st.grad_norm for s, st in trainer.optim_step([0, 1]).items()})
    scores = [s.logprobs for s in trainer.score(rows)]
    for slot in (0, 1):
        trainer.export_peft(slot, Path(out) / f"slot{slot}")
        trainer.save_slot(slot, Path(out) / f"state{slot}")
        if load_from is not None:  # the other layout's saved state, exported from this one
            trainer.close_slot(slot)
            _open(trainer, slot, restore=Path(load_from) / f"state{slot}")
            trainer.export_peft(slot, Path(out) / f"loaded{slot}")
    _turns(trainer, Path(out), rank)
    if rank == 0:
        torch.save({"losses": losses, "norms": norms, "scores": scores}, Path(out) / "result.pt")


def _run(tmp: Path, ep: int, checkpoint: Path, load_from: Path | None = None) -> tuple[dict, Path]:
    out = tmp / f"ep{ep}"
    out.mkdir()
    run_distributed(_job, 2, (ep, str(out), str(checkpoint), None if load_from is None else str(load_from)))
    return torch.load(out / "result.pt"), out


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


@pytest.mark.slow
def test_dp2_ep2_trains_as_dp2_ep1_and_their_states_load_at_either(tmp_path, checkpoint):
    from miles_multilora.models import compat
    from miles_multilora.trainer.rank import TrainerRank

    one, dir_one = _run(tmp_path, 1, checkpoint)
    two, dir_two = _run(tmp_path, 2, checkpoint, load_from=dir_one)
    for step in range(2):
        for slot in (0, 1):
            assert two["losses"][step][slot] == pytest.approx(one["losses"][step][slot], rel=1e-5)
            assert two["norms"][step][slot] == pytest.approx(one["norms"][step][slot], rel=1e-5)
    assert one["norms"][0][0] > 0.05  # slot 0 was clipped
    for a, b in zip(one["scores"], two["scores"], strict=True):
        assert_close_at_scale(torch.tensor(b), torch.tensor(a), 1e-5, "scores")
    for slot in (0, 1):
        w1, w2 = _adapter(dir_one / f"slot{slot}"), _adapter(dir_two / f"slot{slot}")
        assert w1.keys() == w2.keys() and any(".experts.3." in k for k in w1)
        for key in w1:
            assert_close_at_scale(w2[key], w1[key], 1e-4, key)
        # EP=1's state loaded at EP=2 exports exactly EP=1's adapter
        loaded = _adapter(dir_two / f"loaded{slot}")
        assert loaded.keys() == w1.keys() and all(torch.equal(loaded[k], w1[k]) for k in w1)
    assert (dir_two / "state0" / "experts_ep1of2.pt").is_file()
    for directory in (dir_one, dir_two):  # parked, spilled and restored in the other slot: exact
        for slot in (0, 1):
            turned, own = _adapter(directory / f"turn{slot}"), _adapter(directory / f"slot{slot}")
            assert turned.keys() == own.keys() and all(torch.equal(turned[k], own[k]) for k in own)
    # EP=2's state loaded at EP=1 (one rank, here) exports exactly EP=2's adapter
    trainer = TrainerRank(_config(tmp_path / "one", str(checkpoint), 1, 1))
    try:
        for slot in (0, 1):
            _open(trainer, slot, restore=dir_two / f"state{slot}")
            trainer.export_peft(slot, tmp_path / f"from_ep2_{slot}")
            w2, loaded = _adapter(dir_two / f"slot{slot}"), _adapter(tmp_path / f"from_ep2_{slot}")
            assert loaded.keys() == w2.keys() and all(torch.equal(loaded[k], w2[k]) for k in w2)
    finally:
        compat.destroy_distributed()


# rows of different lengths on the two DP (= EP) ranks: 2 rows per micro-batch, so the ranks' micro-batches
# differ in rows and width too (rank 0: rows 0, 2, 4; rank 1: rows 1, 3)
GATHER_ROWS = [(0, 9), (1, 4), (0, 7), (1, 13), (0, 3)]


def _gather_job(rank: int, world: int, ep: int, out: str, hf: str) -> None:
    """One ``forward_backward`` + ``optim_step`` and a ``score`` with the all-gather dispatcher."""
    from miles_multilora.trainer.primitives import ScoredRow
    from miles_multilora.trainer.rank import TrainerRank

    torch.set_num_threads(1)
    cfg = _config(Path(out), hf, ep, world)
    cfg.model.moe_token_dispatcher = "allgather"
    cfg.trainer.micro_batch_size = 2
    trainer = TrainerRank(cfg, rank, world)
    for slot in (0, 1):
        _open(trainer, slot)
    gen = torch.Generator().manual_seed(5)
    rows = [
        ScoredRow(slot, torch.randint(2, 60, (n,), generator=gen).tolist(), list(range(n - 1)), group=i)
        for i, (slot, n) in enumerate(GATHER_ROWS)
    ]
    losses = {s: m["loss"] for s, m in trainer.forward_backward(rows, _loss).per_slot.items()}
    norms = {s: st.grad_norm for s, st in trainer.optim_step([0, 1]).items()}
    scores = [s.logprobs for s in trainer.score(rows)]
    if rank == 0:
        torch.save({"losses": losses, "norms": norms, "scores": scores}, Path(out) / "result.pt")


@pytest.mark.slow  # ~50 s on 2 CPU cores
def test_ep2_allgather_dispatcher_trains_unequal_rows_as_ep1(tmp_path, checkpoint):
    """Megatron's all-gather dispatcher gathers as many tokens from every EP rank: micro-batches of
    different sizes are padded to the EP ranks' largest, and the padding changes no gradient."""
    results = {}
    for ep in (1, 2):
        out = tmp_path / f"gather{ep}"
        out.mkdir()
        run_distributed(_gather_job, 2, (ep, str(out), str(checkpoint)), timeout=150)
        results[ep] = torch.load(out / "result.pt")
    one, two = results[1], results[2]
    for slot in (0, 1):
        assert two["losses"][slot] == pytest.approx(one["losses"][slot], rel=1e-5)
        assert two["norms"][slot] == pytest.approx(one["norms"][slot], rel=1e-5)
        assert one["norms"][slot] > 0
    for a, b in zip(one["scores"], two["scores"], strict=True):
        assert_close_at_scale(torch.tensor(b), torch.tensor(a), 1e-5, "scores")
