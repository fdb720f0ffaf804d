"""A sample ends at the tokenizer's EOS and at every EOS id the checkpoint's generation config declares."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miles_multilora.trainer.tokenizer import ToyTokenizer, stop_token_ids


def test_stop_ids_add_the_generation_configs_eos_ids(tmp_path):
    tokenizer = ToyTokenizer()  # eos 2
    assert stop_token_ids(tokenizer, None) == [2]  # the tiny model: no checkpoint
    assert stop_token_ids(tokenizer, tmp_path) == [2]  # a checkpoint without a generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_token_ids(tokenizer, tmp_path) == [2, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert stop_token_ids(tokenizer, tmp_path) == [2, 7, 9]


def test_the_demo_checkpoint_stops_at_the_end_of_its_turn():
    """The converted demo tokenizer names <|im_start|> its EOS; the reply ends at <|im_end|>."""
    from miles_multilora.models.demo_model import demo_model_dir
    from miles_multilora.trainer.tokenizer import load_tokenizer

    cache = os.path.expanduser(os.environ.get("MILES_MULTILORA_CACHE", "~/.cache/miles_multilora"))
    path = demo_model_dir(Path(cache))
    if not (path / "generation_config.json").is_file():
        pytest.skip(f"the demo model is not converted at {path} (provision.sh)")
    tokenizer = load_tokenizer(path)
    ids = stop_token_ids(tokenizer, path)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == tokenizer.eos_token
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
