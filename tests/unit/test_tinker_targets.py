"""LoRA targets on one in-process trainer rank (tiny model, fp32 CPU, LoRA on attention and MLP): the
Tinker door's train_* flags and ``tinker.unembed_lora``, targets kept through park, spill and restore,
and targets the model does not wrap refused before anything changes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.errors import SpecError
from miles_multilora.lora import multi_lora_layers
from miles_multilora.lora.targets import family_of
from miles_multilora.models import compat
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.requests import Datum, ForwardBackwardRequest, TinkerError
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config

TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[TinkerBackend]:
    cfg = tiny_run_config(
        tmp_path / "run", [], lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 4}
    )
    rank = TrainerRank(cfg)
    try:
        yield TinkerBackend(rank, offload_host_bytes=0)  # every parked model spills to disk
    finally:
        compat.destroy_distributed()


def _step(backend: TinkerBackend, model_id: str) -> None:
    datum = Datum(TEXT[:-1], {"target_tokens": TEXT[1:], "weights": [1.0] * (len(TEXT) - 1)})
    backend.forward_backward([ForwardBackwardRequest(model_id, [datum])])
    backend.optim_step(model_id, lr=1e-2, weight_decay=0.1)


def _mlp_slot(backend: TinkerBackend, model_id: str) -> list[torch.Tensor]:
    slot = backend.model(model_id).slot
    return [
        p[slot]
        for layer in multi_lora_layers(backend.rank.model)
        if family_of(layer.key) == "mlp"
        for p in (layer.lora_A, layer.lora_B)
    ]


def test_the_train_flags_and_the_unembed_policy(backend: TinkerBackend) -> None:
    assert backend.lora_targets(True, True, True) == ("attn", "mlp")  # the SDK's default: unembed ignored
    assert backend.lora_targets(True, False, False) == ("attn",)
    assert backend.lora_targets(False, True, True, "ignore") == ("mlp",)
    with pytest.raises(TinkerError, match="tinker.unembed_lora=ignore") as refused:
        backend.lora_targets(True, True, True, "error")
    assert refused.value.key == "lora_config.train_unembed"
    assert backend.lora_targets(True, True, False, "error") == ("attn", "mlp")
    with pytest.raises(TinkerError, match="trains nothing"):
        backend.lora_targets(False, False, True)


def test_targets_survive_park_spill_and_restore(backend: TinkerBackend) -> None:
    backend.create_model("a", rank=4, seed=0, targets=("attn",))
    _step(backend, "a")
    backend.create_model("b", rank=4, seed=1)
    backend.create_model("c", rank=4, seed=2)  # two slots: "a" is parked, and spilled (budget 0)
    assert "a" in backend.residency.parked and backend.residency.parked["a"].path is not None
    assert backend.model("a").targets == ("attn",)
    _step(backend, "a")  # restored into a slot, and trained on
    assert backend.model("a").targets == ("attn",) and backend.model("a").slot >= 0
    assert all(not t.any() for t in _mlp_slot(backend, "a"))
    other = next(m for m in backend.residency.slots if m != "a")
    assert backend.model(other).targets == ("attn", "mlp")
    assert all(t.any() for t in _mlp_slot(backend, other)[0::2])  # its MLP A: a fresh draw, not zero
    _step(backend, "a")
    assert all(not t.any() for t in _mlp_slot(backend, "a"))


def test_targets_the_model_does_not_wrap_are_refused_before_anything_changes(backend: TinkerBackend) -> None:
    rank = backend.rank
    for targets, message in ((["unembed"], "add output_layer to lora.target_modules"), ([], "empty list")):
        with pytest.raises(SpecError, match=message):
            rank.open_slot(0, 4, 8.0, 0, OptimizerSpec(), "x", targets=targets)
        assert 0 not in rank.slots and all(layer.slot_rank[0] == 0 for layer in multi_lora_layers(rank.model))


def test_the_unembed_policy_setting_is_checked() -> None:
    from miles_multilora.config.run import config_from_container
    from miles_multilora.errors import ConfigError

    with pytest.raises(ConfigError, match="must be one of") as refused:
        config_from_container({"model": {"source": "tiny"}, "tinker": {"unembed_lora": "maybe"}})
    assert refused.value.key == "tinker.unembed_lora"
    assert config_from_container({"model": {"source": "tiny"}}).tinker.unembed_lora == "ignore"
