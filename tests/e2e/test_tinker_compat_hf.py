"""What docs/tinker.md's Compatibility table says of a base model served from an HF checkpoint
directory (here a tiny random Qwen3-MoE with the demo model's tokenizer): ``get_info`` names its
architecture (the checkpoint's ``model_type``, not a fixed ``llama``), and the SDK's
``get_tokenizer`` of a training and a sampling client loads the checkpoint's tokenizer by the base
model's name. Its own module: one trainer per process, and the tiny-model tests hold theirs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Any]]:
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from miles_multilora.config.run import config_from_container
    from miles_multilora.models import compat
    from miles_multilora.models.demo_model import prepare_demo_model
    from miles_multilora.tinker.serve import start

    tokenizer = AutoTokenizer.from_pretrained(prepare_demo_model(os.environ.get("MILES_MULTILORA_CACHE")))
    root = tmp_path_factory.mktemp("tinker_compat_hf")
    checkpoint = root / "qwen3-moe"
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, intermediate_size=64,
        moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(checkpoint, safe_serialization=True)
    tokenizer.save_pretrained(checkpoint)
    cfg = config_from_container({
        "model": {"source": "hf", "hf_path": str(checkpoint)},
        "lora": {"num_slots": 2, "max_rank": 8},
        "trainer": {"output_dir": str(root / "out"), "micro_batch_size": 8},
        "tinker": {"port": 0, "batch_window_s": 0.01},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    server = start(cfg)
    try:
        yield server, checkpoint, tokenizer
    finally:
        server.stop()
        compat.destroy_distributed()


def test_get_info_names_the_checkpoints_architecture_and_get_tokenizer_loads_its_tokenizer(
    served: tuple[Any, Path, Any],
) -> None:
    server, checkpoint, tokenizer = served
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    try:
        tc = sc.create_lora_training_client(base_model=str(checkpoint), rank=4, seed=0).result()
        info = tc.get_info()
        assert (info.model_data.arch, info.model_data.model_name) == ("qwen3_moe", str(checkpoint))
        text = "The capital of France is Paris."
        assert tc.get_tokenizer().encode(text) == tokenizer.encode(text)
        sampler = sc.create_sampling_client(base_model=str(checkpoint)).result()
        assert sampler.get_tokenizer().encode(text) == tokenizer.encode(text)
    finally:
        sc.close("success").result()
