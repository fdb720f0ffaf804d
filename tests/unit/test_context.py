"""The context window: the checkpoint's own max_position_embeddings (no fixed cap), the tiny model's
max_seq_len, model.max_context lowering it (never raising it), and the rank built with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_multilora.config.run import config_from_container, load_run_config
from miles_multilora.errors import ConfigError
from miles_multilora.models import compat
from miles_multilora.models.paths import context_length
from tests.e2e.conftest import tiny_run_config


def hf_config(tmp_path: Path, **model: object) -> object:
    return config_from_container({"model": {"source": "hf", "hf_path": str(tmp_path), **model}})


def write_checkpoint_config(path: Path, **fields: object) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **fields}))


def test_the_checkpoints_own_context_is_used_beyond_4096(tmp_path: Path) -> None:
    write_checkpoint_config(tmp_path, max_position_embeddings=32768)
    assert context_length(hf_config(tmp_path)) == 32768
    assert context_length(hf_config(tmp_path, max_context=20000)) == 20000


def test_a_cap_above_the_checkpoints_context_is_refused(tmp_path: Path) -> None:
    write_checkpoint_config(tmp_path, max_position_embeddings=8192)
    with pytest.raises(ConfigError) as err:
        context_length(hf_config(tmp_path, max_context=16384))
    assert err.value.key == "model.max_context" and "8192" in err.value.message


def test_a_checkpoint_without_a_context_needs_model_max_context(tmp_path: Path) -> None:
    write_checkpoint_config(tmp_path)
    with pytest.raises(ConfigError) as err:
        context_length(hf_config(tmp_path))
    assert err.value.key == "model.max_context" and "max_position_embeddings" in err.value.message
    assert context_length(hf_config(tmp_path, max_context=4000)) == 4000


def test_the_tiny_model_context_and_its_cap() -> None:
    assert context_length(load_run_config("train", ["model=tiny", "model.tiny.max_seq_len=512"])) == 512
    capped = load_run_config("train", ["model=tiny", "model.max_context=100"])
    assert context_length(capped) == 100
    with pytest.raises(ConfigError, match="exceeds"):
        context_length(load_run_config("train", ["model=tiny", "model.max_context=100000"]))
    with pytest.raises(ConfigError, match=">= 2"):
        load_run_config("train", ["model=tiny", "model.max_context=1"])


def test_the_rank_and_engine_use_the_capped_context_and_resolve_auto_recompute(tmp_path: Path) -> None:
    from miles_multilora.trainer.rank import TrainerRank

    cfg = tiny_run_config(tmp_path, [], model={"source": "tiny", "max_context": 96})
    assert cfg.trainer.recompute == "auto"  # the default
    rank = TrainerRank(cfg)
    try:
        assert rank.max_seq_len == 96 and rank.engine.max_seq_len == 96
        assert cfg.trainer.recompute == "none"  # the tiny model fits without recompute
        if torch.cuda.is_available():
            assert rank.memory_plan is not None and rank.memory_plan.tokens == 8 * 96  # 8 rows of 96
        else:
            assert rank.memory_plan is None  # CPU: nothing to plan
    finally:
        compat.destroy_distributed()
