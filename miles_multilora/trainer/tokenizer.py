"""Tokenizers: the HF tokenizer of a checkpoint dir (with its chat template), or a toy one for tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ToyTokenizer:
    """Byte-level tokenizer for the tiny test model: printable ASCII keeps its code, 0 pads, 2 ends.

    It has no chat template, so prompts are used as rendered by the adapter's prompt template.
    """

    pad_token_id = 0
    eos_token_id = 2
    chat_template = None

    def __init__(self, vocab_size: int = 128) -> None:
        if vocab_size < 128:
            raise ValueError("the toy tokenizer needs vocab_size >= 128")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b if 32 <= b < 127 or b == 10 else 63 for b in text.encode("ascii", errors="replace")]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in token_ids if 32 <= t < 127 or t == 10)


def load_tokenizer(model_dir: str | Path | None, vocab_size: int | None = None) -> Any:
    """The checkpoint's HF tokenizer, or a :class:`ToyTokenizer` when there is no checkpoint."""
    if model_dir is None:
        return ToyTokenizer(vocab_size or 128)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a rendered prompt. A chat-templated prompt already holds its special tokens."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    return list(tokenizer(prompt, add_special_tokens=not has_template)["input_ids"])


def stop_token_ids(tokenizer: Any, model_dir: str | Path | None) -> list[int]:
    """The ids that end a sample: the tokenizer's EOS and every EOS id the checkpoint's
    ``generation_config.json`` declares (an end-of-turn token such as ChatML's ``<|im_end|>``), as
    transformers' ``generate``, vLLM and TRL stop. The demo checkpoint's tokenizer names
    ``<|im_start|>`` its EOS: without its generation config's ``<|im_end|>`` a reply would run on
    past the end of its turn to ``max_new_tokens``."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(int(eos))
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        declared = json.loads(path.read_text()).get("eos_token_id")
        for token in [declared] if isinstance(declared, int) else declared or []:
            if int(token) not in ids:
                ids.append(int(token))
    return ids
