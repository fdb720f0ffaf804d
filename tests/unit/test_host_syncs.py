"""A training call makes the host wait for the GPU a fixed number of times, however many rows and
micro-batches it has (the tiny Megatron model on a GPU, a real trainer rank, the RL loss; syncs
counted by ``torch.cuda.set_sync_debug_mode``). A copy of host data per row, as the padding of each
row once was, would make every row drain the GPU's queue; a read per micro-batch (the routing
plan's counts, the loss metrics), every micro-batch."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch

from miles_multilora.algo import AlgoConfig
from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.models import compat
from miles_multilora.rl.train import rl_loss
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config


def rows(n: int) -> list[ScoredRow]:
    out = []
    for i in range(n):
        tokens = [3 + (7 * i + j) % 50 for j in range(12 + i % 5)]
        width = len(tokens) - 1
        values = {"old_logprobs": [-1.0] * width, "advantages": [0.5 - i % 2] * width}
        out.append(ScoredRow(slot=i % 3, tokens=tokens, positions=list(range(width)), values=values))
    return out


def syncs(rank: TrainerRank, n: int) -> list[str]:
    """Where one call of ``n`` rows makes the host wait: the last frames of each sync ("" when no
    Python frame was on the stack: an autograd engine thread's op)."""
    batch = rows(n)
    loss = rl_loss(AlgoConfig(), {s: 100.0 for s in range(3)})
    rank.forward_backward(batch, loss)  # warm-up: kernels compiled, allocations made
    torch.cuda.synchronize()
    seen: list[str] = []

    def note(message: Warning | str, *_: object, **__: object) -> None:
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-1]
            if any(f.name == "set_sync_debug_mode" for f in frames):
                return  # the switch itself warns once per process
            seen.append(
                " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-5:]))
            )

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rank.forward_backward(batch, loss)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return seen


@pytest.mark.gpu
def test_a_training_call_waits_for_the_gpu_a_fixed_number_of_times(tmp_path: Path) -> None:
    cfg = tiny_run_config(
        tmp_path / "run", [], lora={"num_slots": 3, "max_rank": 8}, trainer={"micro_batch_size": 4}
    )
    rank = TrainerRank(cfg)
    try:
        for slot in range(3):
            rank.open_slot(slot, 8, 16.0, slot, OptimizerSpec(lr=1e-3), f"a{slot}")
        few, many = syncs(rank, 4), syncs(rank, 48)  # one micro-batch, twelve
        assert len(few) == len(many), "\n".join(["4 rows:", *few, "48 rows:", *many])
        assert len(many) <= 2, many  # the metrics and the logprobs, each read once for the call
    finally:
        compat.destroy_distributed()
