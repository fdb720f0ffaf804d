"""Training-throughput options change speed, never the update: micro-batches by a token budget,
activation recompute and small LM-head chunks give the same per-slot gradients as the default
(fp32 CPU, up to summation order), the per-adapter loss normalised over the whole step. Gradients,
not weights after AdamW, are compared: Adam's first steps turn ulp-level differences of tiny
gradients into large relative weight differences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from tests.e2e.conftest import snapshot_of, tiny_run_config, toy_adapter


def _specs() -> list[dict[str, Any]]:
    return [
        toy_adapter("a", "fraction_of_lowercase", steps=4, sampling={"max_new_tokens": 16}),
        toy_adapter("b", "fraction_of_digits", steps=4, batched=True, seed=7),
    ]


def _gradients_of_one_step(out: Path, **trainer: Any) -> dict[str, torch.Tensor]:
    cfg = tiny_run_config(out, _specs(), trainer={"micro_batch_size": 3, **trainer})
    worker = RLStep.build(cfg)
    grads: dict[str, torch.Tensor] = {}
    step = worker.rank.optimizer.step

    def record_then_step(active: list[int]) -> Any:
        grads.update(
            {
                n: p.grad.detach().clone()
                for n, p in worker.rank.model.named_parameters()
                if p.grad is not None
            }
        )
        return step(active)

    worker.rank.optimizer.step = record_then_step  # type: ignore[method-assign]
    try:
        out_step = worker.step(snapshot_of(1, _specs()))
        assert all(r.trained for r in out_step.results.values())
        return grads
    finally:
        compat.destroy_distributed()


@pytest.mark.parametrize(
    "option",
    [{"max_tokens_per_micro_batch": 64}, {"recompute": "full"}, {"logprob_chunk_tokens": 5}],
    ids=["token-budget", "recompute", "small-chunks"],
)
def test_throughput_options_give_the_same_update(tmp_path: Path, option: dict[str, Any]) -> None:
    default = _gradients_of_one_step(tmp_path / "default")
    other = _gradients_of_one_step(tmp_path / "other", **option)
    assert default.keys() == other.keys() and any(g.abs().max() > 0 for g in default.values())
    for name, value in default.items():
        scale = max(float(value.abs().max()), 1e-12)
        assert float((other[name] - value).abs().max()) <= 1e-5 * scale, name
