"""An adapter spec's ``lora_targets`` through the RL recipe: parsed and checked (a clear error naming
the key), admitted only for families the model wraps, carried by the controller to the trainer's
slot, and kept in checkpoints (shard meta, PEFT export of the targeted modules only) and on resume.
The real controller core, RL step and trainer rank (tiny model, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles_multilora.config.adapter import OptimizerSpec, parse_adapter_spec
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.admission import AdmissionRules
from miles_multilora.errors import SpecError
from miles_multilora.lora import slot_targets
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from miles_multilora.trainer.rank import TrainerRank
from miles_multilora.trainer.shard import read_shard, shard_meta
from tests.e2e.conftest import final_checkpoint, tiny_run_config
from tests.unit.test_rl_step import adapter, run


def test_the_spec_field_is_checked_and_serialised_only_when_set() -> None:
    spec = parse_adapter_spec(adapter("a", 1, lora_targets=["mlp", "attn"]))
    assert spec.lora_targets == ["attn", "mlp"] and spec.to_dict()["lora_targets"] == ["attn", "mlp"]
    assert parse_adapter_spec(spec.to_dict()).lora_targets == ["attn", "mlp"]
    assert "lora_targets" not in parse_adapter_spec(adapter("b", 1)).to_dict()
    for bad, message in (([], "empty list"), (["ffn"], "unknown"), ("attn", "lora_targets")):
        with pytest.raises(SpecError, match=message) as refused:
            parse_adapter_spec(adapter("c", 1, lora_targets=bad))
        assert refused.value.key == "lora_targets"
    core = ControllerCore(num_slots=2, max_rank=8, rules=AdmissionRules(lora_families=("attn", "mlp")))
    with pytest.raises(SpecError, match="add output_layer to lora.target_modules"):
        core.register(adapter("d", 1, lora_targets=["unembed"]))
    assert core.list() == []  # refused before any change


def test_targets_travel_to_the_slot_and_into_checkpoints_and_resume(tmp_path: Path) -> None:
    specs = [adapter("attn_only", 2, lora_targets=["attn"]), adapter("all", 2)]
    cfg = tiny_run_config(tmp_path / "out", specs, lora={"num_slots": 2, "max_rank": 8})
    core = ControllerCore(num_slots=2, max_rank=8, rules=AdmissionRules(lora_families=("attn", "mlp")))
    for spec in specs:
        core.register(spec)
    rank = TrainerRank(cfg)
    try:
        step = RLStep(rank, cfg)
        run(core, [step])
        assert {r["name"]: r["state"] for r in core.list()} == {"attn_only": "DONE", "all": "DONE"}
        last = final_checkpoint(cfg.trainer.output_dir, "attn_only")
        assert shard_meta(read_shard(last, 0)).targets == ("attn",)
        peft = last / "adapter"
        assert sorted(json.loads((peft / "adapter_config.json").read_text())["target_modules"]) == [
            "k_proj", "o_proj", "q_proj", "v_proj",
        ]  # fmt: skip
        assert not any(".mlp." in k for k in load_file(str(peft / "adapter_model.safetensors")))
        full = final_checkpoint(cfg.trainer.output_dir, "all")
        assert shard_meta(read_shard(full, 0)).targets == ("attn", "mlp")

        free = rank.free_slots()[0]  # resume: the checkpoint opens with its own targets only
        with pytest.raises(SpecError, match=r"the saved state trains \['attn'\]"):
            rank.open_slot(free, 4, 8.0, 1, OptimizerSpec(), "again", restore=last)
        assert free not in rank.slots
        rank.open_slot(free, 4, 8.0, 1, OptimizerSpec(), "again", restore=last, targets=["attn"])
        assert slot_targets(rank.model, free) == ("attn",)
    finally:
        compat.destroy_distributed()
