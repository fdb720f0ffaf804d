"""End-to-end training on the tiny model: the rollout = trainer invariant inside the training
step, and rewards that rise for two adapters with different reward functions trained together."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from miles_multilora.scoring.logprobs import right_pad, sequence_logprobs
from miles_multilora.trainer.primitives import ScoredRow
from tests.e2e.conftest import final_checkpoint, snapshot_of, tiny_run_config, toy_adapter

STEPS = 12
# Low temperature sharpens the random model's flat logits so a rank-4 LoRA moves the sampled
# distribution within a dozen steps (the logprobs are taken at the same temperature).
LEARNABLE = {"sampling": {"temperature": 0.2}, "optimizer": {"lr": 5e-2}, "n_samples_per_prompt": 8}


def _two_adapters(steps: int) -> list[dict[str, Any]]:
    return [
        toy_adapter("lower", "fraction_of_lowercase", steps=steps, **LEARNABLE),
        toy_adapter("digits", "fraction_of_digits", steps=steps, batched=True, **LEARNABLE),
    ]


class ParityCheck:
    """Wraps a real trainer rank's ``sample`` and ``forward_backward``: every sample must carry the
    tags of its request and of the rank's slot (adapter, slot, current version), and before the
    training forward/backward each row's rollout logprobs (the loss's ``old_logprobs``) are
    compared with the trainer's own forward at the row's slot and temperature."""

    def __init__(self, step: RLStep) -> None:
        self.rank = step.rank
        self.max_diffs: list[float] = []
        self.tag_errors: list[str] = []
        self.samples_checked = 0
        sample, forward_backward = self.rank.sample, self.rank.forward_backward

        def checked_sample(groups: Any) -> Any:
            out = sample(groups)
            for requests, results in zip(groups, out, strict=True):
                for q, r in zip(requests, results, strict=True):
                    live = self.rank.slots[q.slot]
                    if (r.adapter, r.slot, r.version) != (q.adapter, q.slot, q.version) or (
                        (live.name, live.version) != (q.adapter, q.version)
                    ):
                        self.tag_errors.append(f"{q.adapter}: got {(r.adapter, r.slot, r.version)}")
            return out

        def checked_forward_backward(rows: list[ScoredRow], loss_fn: Any, **kwargs: Any) -> Any:
            for row in rows:
                ids, _ = right_pad([row.tokens], self.rank.pad_id)
                with torch.no_grad():
                    lp = sequence_logprobs(
                        self.rank.model, ids, [row.slot], [row.temperature], self.rank.vocab_size
                    )[0]
                trainer_lp = lp[row.positions[0] : row.positions[-1] + 1]
                self.max_diffs.append(
                    float((trainer_lp - torch.tensor(row.values["old_logprobs"])).abs().max())
                )
                self.samples_checked += 1
            return forward_backward(rows, loss_fn, **kwargs)

        self.rank.sample = checked_sample  # type: ignore[method-assign]
        self.rank.forward_backward = checked_forward_backward  # type: ignore[method-assign]


@pytest.fixture
def checked_step(tmp_path: Any) -> Iterator[tuple[RLStep, ParityCheck]]:
    step = RLStep.build(tiny_run_config(tmp_path / "run", _two_adapters(steps=3)))
    yield step, ParityCheck(step)
    compat.destroy_distributed()


def test_rollout_logprobs_equal_trainer_logprobs_in_the_training_step(
    checked_step: tuple[RLStep, ParityCheck],
) -> None:
    worker, check = checked_step
    specs = _two_adapters(steps=3)
    before = {n: p.detach().clone() for n, p in worker.rank.model.named_parameters() if "lora_B" in n}
    for i in range(2):  # step 2 samples from updated (non-zero) LoRA weights, version 1
        out = worker.step(snapshot_of(i + 1, specs, worker.versions(), init=i == 0))
        assert {n: r.step for n, r in out.results.items()} == {"lower": i + 1, "digits": i + 1}
        assert all(r.trained for r in out.results.values())
    assert check.samples_checked >= 2 * 2 * 2 * 8 * 0.9  # steps x adapters x prompts x samples
    assert not check.tag_errors, check.tag_errors[:5]
    assert max(check.max_diffs) <= 1e-5
    moved = [
        n for n, p in worker.rank.model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])
    ]
    assert moved, "the optimizer step did not change any LoRA weight"


def _reward_curve(rows: list[dict[str, Any]], adapter: str) -> list[float]:
    mine = sorted((r for r in rows if r["adapter"] == adapter), key=lambda r: r["step"])
    return [r["reward_mean"] for r in mine]


def test_rewards_rise_for_two_adapters_with_different_rewards(tmp_path: Any, ray_session: None) -> None:
    from miles_multilora.launch.run import run_training

    out = tmp_path / "run"
    records = run_training(tiny_run_config(out, _two_adapters(STEPS)))

    assert {n: (r["state"], r["step"]) for n, r in records.items()} == {
        "lower": ("DONE", STEPS),
        "digits": ("DONE", STEPS),
    }
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for adapter in ("lower", "digits"):
        curve = _reward_curve(rows, adapter)
        assert len(curve) == STEPS
        first, last = sum(curve[:2]) / 2, sum(curve[-2:]) / 2
        assert last >= first + 0.1, f"{adapter} reward did not rise: {[round(x, 3) for x in curve]}"
        ckpt_dir = final_checkpoint(out, adapter)
        assert ckpt_dir.name == f"step_{STEPS:06d}"
        assert (ckpt_dir / "adapter" / "adapter_model.safetensors").is_file()
        assert records[adapter]["last_checkpoint"] == str(ckpt_dir)
