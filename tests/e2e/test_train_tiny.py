"""End-to-end training on the tiny model: the rollout = trainer invariant inside the training
step, and rewards that rise for two adapters with different reward functions trained together."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from miles_multilora.models import compat
from miles_multilora.rollout.logprobs import right_pad, sequence_logprobs
from miles_multilora.trainer.worker import Group, TrainerWorker
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


class ParityCheckingWorker(TrainerWorker):
    """A real trainer rank that, before each optimizer step, recomputes every rollout sample's
    logprobs with the trainer's own forward and records the largest difference and the tags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_diffs: list[float] = []
        self.tag_errors: list[str] = []
        self.samples_checked = 0

    def _train(self, groups: list[Group]) -> dict[str, dict[str, float]]:
        for g in groups:
            assignment = self.resident[g.adapter]
            temp = assignment.spec.sampling.temperature
            for r in g.results:
                if (r.adapter, r.slot, r.version) != (g.adapter, assignment.slot, self.steps[g.adapter]):
                    self.tag_errors.append(f"{g.adapter}: got {(r.adapter, r.slot, r.version)}")
                if not r.output_ids:
                    continue
                ids, _ = right_pad([list(r.prompt_ids) + list(r.output_ids)], self.pad_id)
                with torch.no_grad():
                    lp = sequence_logprobs(self.model, ids, [r.slot], [temp], self.vocab_size)[0]
                start = len(r.prompt_ids) - 1
                trainer_lp = lp[start : start + len(r.output_ids)]
                self.max_diffs.append(float((trainer_lp - torch.tensor(r.logprobs)).abs().max()))
                self.samples_checked += 1
        return super()._train(groups)


@pytest.fixture
def in_process_worker(tmp_path: Any) -> Iterator[ParityCheckingWorker]:
    cfg = tiny_run_config(tmp_path / "run", _two_adapters(steps=3))
    worker = ParityCheckingWorker(cfg)
    yield worker
    compat.destroy_distributed()


def test_rollout_logprobs_equal_trainer_logprobs_in_the_training_step(
    in_process_worker: ParityCheckingWorker,
) -> None:
    worker = in_process_worker
    specs = _two_adapters(steps=3)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if "lora_B" in n}
    for i in range(2):  # step 2 samples from updated (non-zero) LoRA weights, version 1
        out = worker.step(snapshot_of(i + 1, specs, dict(worker.steps), init=i == 0))
        assert {n: r["step"] for n, r in out["results"].items()} == {"lower": i + 1, "digits": i + 1}
        assert all(r["trained"] for r in out["results"].values())
    assert worker.samples_checked >= 2 * 2 * 2 * 8 * 0.9  # steps x adapters x prompts x samples
    assert not worker.tag_errors, worker.tag_errors[:5]
    assert max(worker.max_diffs) <= 1e-5
    moved = [n for n, p in worker.model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])]
    assert moved, "the optimizer step did not change any LoRA weight"


def _reward_curve(rows: list[dict[str, Any]], adapter: str) -> list[float]:
    mine = sorted((r for r in rows if r["adapter"] == adapter), key=lambda r: r["step"])
    return [r["reward_mean"] for r in mine]


def test_rewards_rise_for_two_adapters_with_different_rewards(tmp_path: Any, ray_session: None) -> None:
    from miles_multilora.trainer.run import run_training

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
