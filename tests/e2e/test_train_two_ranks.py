"""A 2-rank run (two Ray trainer actors, gloo, tensor parallel 2) trains to DONE and ends with the
adapters of the 1-rank run (TP changes only the reduction order)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from miles_multilora.rl import checkpoint as ckpt
from miles_multilora.trainer.shard import read_shard
from tests.e2e.conftest import final_checkpoint, max_abs_diff, tiny_run_config, toy_adapter

STEPS = 3
ADAPTERS = [
    toy_adapter("lower", "fraction_of_lowercase", steps=STEPS),
    toy_adapter("digits", "fraction_of_digits", steps=STEPS, batched=True),
]


def _peft(path: Path) -> dict:
    return load_file(str(path / "adapter" / "adapter_model.safetensors"))


def test_two_rank_tensor_parallel_run_matches_one_rank_run(tmp_path: Path, ray_session: None) -> None:
    from miles_multilora.launch.run import run_training

    two = tmp_path / "tp2"
    records = run_training(
        tiny_run_config(two, ADAPTERS, trainer={"world_size": 2}, model={"source": "tiny", "tp": 2})
    )
    assert {n: (r["state"], r["step"]) for n, r in records.items()} == {
        "lower": ("DONE", STEPS),
        "digits": ("DONE", STEPS),
    }
    one = tmp_path / "tp1"
    run_training(tiny_run_config(one, ADAPTERS))

    for name in ("lower", "digits"):
        a, b = final_checkpoint(two, name), final_checkpoint(one, name)
        assert (a / "slot_rank0.pt").is_file() and (a / "slot_rank1.pt").is_file()
        shards = [read_shard(a, r)["slot"] for r in (0, 1)]
        assert any(not shards[0][k].equal(shards[1][k]) for k in shards[0] if k.endswith("lora_A")), (
            "the two ranks hold identical shards: tensor parallelism did not split the LoRA weights"
        )
        peft_two, peft_one = _peft(a), _peft(b)
        assert max(float(t.abs().max()) for k, t in peft_one.items() if "lora_B" in k) > 0, name
        assert max_abs_diff(peft_two, peft_one) <= 1e-4, name
        assert ckpt.read_state(a)["data"] == ckpt.read_state(b)["data"], name
