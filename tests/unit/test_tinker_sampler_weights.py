"""Saved sampler weights on one in-process trainer rank (tiny model, CPU): a sampler serves its
model's slot while that holds its weights and a copy once the model moved on; a tenant's unnamed
saves past ``tinker.max_unnamed_sampler_weights`` and a replaced named save answer clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.models import compat
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.catalog import Catalog
from miles_multilora.tinker.registry import OwnedModel
from miles_multilora.tinker.requests import ForwardBackwardRequest, TinkerError
from miles_multilora.tinker.sampler_weights import SamplerWeights
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config
from tests.unit.test_tinker_backend import TEXT, sft_datum


@pytest.fixture
def weights(tmp_path: Path) -> Iterator[tuple[SamplerWeights, OwnedModel]]:
    cfg = tiny_run_config(
        tmp_path / "run", [], lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 4}
    )
    backend = TinkerBackend(TrainerRank(cfg))
    catalog = Catalog(tmp_path / "state", max_checkpoints=10, max_runs=10)
    owned = OwnedModel("sess-1:train:0", "t-a", "sess-1", "run-1")
    backend.create_model(owned.model_id, rank=4, seed=1)
    catalog.add_run("t-a", "run-1", "sess-1", owned.model_id, "tiny", 4, None)
    try:
        yield SamplerWeights(catalog, backend, TinkerConfig(max_unnamed_sampler_weights=1)), owned
    finally:
        compat.destroy_distributed()


def step(sw: SamplerWeights, owned: OwnedModel) -> None:
    sw.backend.forward_backward([ForwardBackwardRequest(owned.model_id, [sft_datum(TEXT)])])
    sw.backend.optim_step(owned.model_id, lr=1e-2)


def test_the_live_slot_until_the_model_moves_on_then_a_copy(
    weights: tuple[SamplerWeights, OwnedModel],
) -> None:
    sw, owned = weights
    saved = sw.save_unnamed("t-a", owned, "sess-1:sample:0")
    assert sw.serve("t-a", saved) == owned.model_id  # no copy while the slot holds these weights
    step(sw, owned)
    copy = sw.serve("t-a", saved)
    assert copy != owned.model_id and copy in sw.backend.copies
    assert sw.serve("t-a", saved) == copy and sw.backend.stats["copies_loaded"] == 1  # loaded once

    newer = sw.save_unnamed("t-a", owned, "sess-1:sample:1")  # past max_unnamed_sampler_weights=1
    assert not saved.directory.exists() and copy not in sw.backend.copies
    with pytest.raises(TinkerError, match="tinker.max_unnamed_sampler_weights"):
        sw.serve("t-a", saved)
    assert sw.serve("t-a", newer) == owned.model_id


def test_a_copy_keeps_the_models_lora_targets(tmp_path: Path) -> None:
    """An attention-only model's saved weights load into a copy that also trains attention only."""
    cfg = tiny_run_config(
        tmp_path / "run", [], lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 4}
    )
    backend = TinkerBackend(TrainerRank(cfg))
    try:
        catalog = Catalog(tmp_path / "state", max_checkpoints=10, max_runs=10)
        owned = OwnedModel("sess-1:train:0", "t-a", "sess-1", "run-1")
        backend.create_model(owned.model_id, rank=4, seed=1, targets=("attn",))
        catalog.add_run("t-a", "run-1", "sess-1", owned.model_id, "tiny", 4, None)
        sw = SamplerWeights(catalog, backend, TinkerConfig())
        saved = sw.save_unnamed("t-a", owned, "sess-1:sample:0")
        step(sw, owned)
        copy = sw.serve("t-a", saved)
        assert copy != owned.model_id and backend.model(copy).targets == ("attn",)
    finally:
        compat.destroy_distributed()


def test_a_named_save_replaced_by_a_new_one_answers_so(weights: tuple[SamplerWeights, OwnedModel]) -> None:
    sw, owned = weights
    first = sw.save_named("t-a", owned, "n", ttl_s=None, user_metadata=None)
    step(sw, owned)
    sw.serve("t-a", first)  # a copy of the first save
    second = sw.save_named("t-a", owned, "n", ttl_s=None, user_metadata=None)
    assert second.key != first.key and not sw.backend.copies  # the old copy was evicted
    with pytest.raises(TinkerError, match="were deleted, expired or replaced"):
        sw.serve("t-a", first)
    assert sw.open("t-a", "run-1", "n") == second and sw.serve("t-a", second) == owned.model_id
    assert sorted(p.name for p in first.directory.parent.iterdir()) == ["n"]  # no staging left


def test_the_limits_are_configured_and_checked() -> None:
    from miles_multilora.config.run import config_from_container, load_run_config
    from miles_multilora.errors import ConfigError

    cfg = load_run_config("tinker", ["model=tiny", "tinker.max_sampler_copies_per_tenant=2"])
    assert (cfg.tinker.max_sampler_copies_per_tenant, cfg.tinker.max_unnamed_sampler_weights) == (2, 64)
    for key in ("max_sampler_copies_per_tenant", "max_unnamed_sampler_weights"):
        with pytest.raises(ConfigError) as info:
            config_from_container({"model": {"source": "tiny"}, "tinker": {key: 0}})
        assert info.value.key == f"tinker.{key}"
