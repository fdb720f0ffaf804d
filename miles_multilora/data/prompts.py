"""Turning a dataset row into the prompt text the rollout engine sees."""

from __future__ import annotations

from typing import Any

from miles_multilora.config.adapter import PromptSpec
from miles_multilora.data.records import DatasetRow
from miles_multilora.errors import SpecError


def fill_template(row: DatasetRow, template: str) -> str:
    """``template`` formatted with the row's fields; ``{prompt}`` is the question text.

    Raises :class:`SpecError` on ``prompt.template`` when a field is missing or the template is malformed.
    """
    values = {**row.fields, "prompt": row.prompt}
    try:
        return template.format_map(values)
    except KeyError as exc:
        raise SpecError(
            "prompt.template", f"uses field {exc} that the dataset row lacks; available: {sorted(values)}"
        ) from exc
    except (ValueError, IndexError, AttributeError) as exc:
        raise SpecError("prompt.template", f"is not a valid format string: {exc}") from exc


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` is a HF tokenizer with a chat template set."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(row: DatasetRow, prompt_spec: PromptSpec, tokenizer: Any | None = None) -> str:
    """The final prompt text of ``row`` for an adapter with ``prompt_spec``.

    With ``use_chat_template`` and a tokenizer that has a chat template, the filled template
    becomes the user message (after the optional system prompt) and the tokenizer's template is
    applied with the generation prompt. Otherwise the system prompt, if any, is prepended as a
    paragraph.
    """
    text = fill_template(row, prompt_spec.template)
    if prompt_spec.use_chat_template and has_chat_template(tokenizer):
        messages = []
        if prompt_spec.system_prompt:
            messages.append({"role": "system", "content": prompt_spec.system_prompt})
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if prompt_spec.system_prompt:
        return f"{prompt_spec.system_prompt}\n\n{text}"
    return text
