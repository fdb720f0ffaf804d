"""The trainer on a tiny mixture-of-experts model (``model.tiny.num_experts``): two adapters train
together on LoRA over attention and every expert, rollout logprobs equal the trainer's inside the
step, checkpoints hold the experts' LoRA in PEFT's layout, and full recompute (the MoE layer run
again in backward) gives the same gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from tests.e2e.conftest import final_checkpoint, snapshot_of, tiny_run_config
from tests.e2e.test_train_tiny import ParityCheck, _two_adapters

MOE = {"tiny": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}}


def _config(out: Path, steps: int, dispatcher: str = "alltoall", **sections: Any):
    specs = _two_adapters(steps)
    for spec in specs:
        spec["save_interval"] = steps
    model = {**MOE, "moe_token_dispatcher": dispatcher}
    return tiny_run_config(out, specs, model=model, **sections), specs


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_adapters_train_with_rollout_equal_to_trainer(tmp_path: Path, dispatcher: str) -> None:
    cfg, specs = _config(tmp_path / "run", steps=2, dispatcher=dispatcher)
    worker = RLStep.build(cfg)
    check = ParityCheck(worker)
    model = worker.rank.model
    try:
        experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts.lora." in n}
        assert experts and all("lora_" in n for n in experts)
        for i in range(2):
            out = worker.step(snapshot_of(i + 1, specs, worker.versions(), init=i == 0))
            assert all(r.trained for r in out.results.values())
        assert check.samples_checked > 0 and not check.tag_errors
        assert max(check.max_diffs) <= 1e-5
        for name, before in experts.items():
            if name.endswith("lora_B"):
                after = dict(model.named_parameters())[name]
                assert not torch.equal(after[:2], before[:2]), f"{name} did not train"
        for adapter in ("lower", "digits"):
            weights = load_file(
                str(
                    final_checkpoint(cfg.trainer.output_dir, adapter)
                    / "adapter"
                    / "adapter_model.safetensors"
                )
            )
            assert "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in weights
    finally:
        compat.destroy_distributed()


def _gradients_of_one_step(out: Path, **trainer: Any) -> dict[str, torch.Tensor]:
    cfg, specs = _config(out, steps=2, trainer={"micro_batch_size": 3, **trainer})
    worker = RLStep.build(cfg)
    grads: dict[str, torch.Tensor] = {}
    model, optimizer = worker.rank.model, worker.rank.optimizer
    step = optimizer.step

    def record_then_step(*args: Any, **kwargs: Any) -> Any:
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    optimizer.step = record_then_step  # type: ignore[method-assign]
    try:
        assert all(r.trained for r in worker.step(snapshot_of(1, specs)).results.values())
        return grads
    finally:
        compat.destroy_distributed()


def test_full_recompute_of_the_moe_layer_gives_the_same_update(tmp_path: Path) -> None:
    default = _gradients_of_one_step(tmp_path / "default")
    recomputed = _gradients_of_one_step(tmp_path / "recompute", recompute="full")
    assert default.keys() == recomputed.keys() and any(".experts." in n for n in default)
    for name, value in default.items():
        scale = max(float(value.abs().max()), 1e-12)
        assert float((recomputed[name] - value).abs().max()) <= 1e-5 * scale, name
