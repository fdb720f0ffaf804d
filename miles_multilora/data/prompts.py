"""Turning a dataset row into the prompt text the rollout engine sees."""

from __future__ import annotations

from typing import Any

from miles_multilora.config.adapter import PromptSpec
from miles_multilora.config.template import parse_template
from miles_multilora.data.records import DatasetRow
from miles_multilora.errors import SpecError

DEFAULT_MAX_PROMPT_CHARS = 100_000  # trainer.max_prompt_chars


def fill_template(row: DatasetRow, template: str, max_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> str:
    """``template``'s plain ``{field}`` placeholders filled with the row's fields (``{prompt}`` is
    the question text), at most ``max_chars`` characters.

    Raises :class:`SpecError` on ``prompt.template`` when the template is not plain (see
    :mod:`miles_multilora.config.template`), a field is missing or null in the row, or the text
    would be longer than ``max_chars`` (checked before it is built).
    """
    values = {**row.fields, "prompt": row.prompt}
    parts: list[str] = []
    length = 0
    for literal, field in parse_template(template):
        parts.append(literal)
        length += len(literal)
        if field is None:
            continue
        if field not in values:
            raise SpecError(
                "prompt.template",
                f"uses field {field!r} that the dataset row lacks; available: {sorted(values)}",
            )
        value = values[field]
        if value is None:
            raise SpecError(
                "prompt.template", f"field {field!r} is null in this row; fill it or drop the row"
            )
        text = value if isinstance(value, str) else str(value)
        parts.append(text)
        length += len(text)
        if length > max_chars:
            break
    if length > max_chars:
        raise SpecError(
            "prompt.template",
            f"the rendered prompt is longer than {max_chars} characters (trainer.max_prompt_chars); "
            "shorten the template or the dataset's fields",
        )
    return "".join(parts)


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` is a HF tokenizer with a chat template set."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    row: DatasetRow,
    prompt_spec: PromptSpec,
    tokenizer: Any | None = None,
    max_chars: int = DEFAULT_MAX_PROMPT_CHARS,
) -> str:
    """The final prompt text of ``row`` for an adapter with ``prompt_spec``.

    With ``use_chat_template`` and a tokenizer that has a chat template, the filled template
    becomes the user message (after the optional system prompt) and the tokenizer's template is
    applied with the generation prompt. Otherwise the system prompt, if any, is prepended as a
    paragraph. ``max_chars`` bounds the filled template (:func:`fill_template`).
    """
    text = fill_template(row, prompt_spec.template, max_chars)
    if prompt_spec.use_chat_template and has_chat_template(tokenizer):
        messages = chat_messages(text, prompt_spec)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if prompt_spec.system_prompt:
        return f"{prompt_spec.system_prompt}\n\n{text}"
    return text


def chat_messages(text: str, prompt_spec: PromptSpec) -> list[dict[str, str]]:
    """The chat a filled template becomes under a chat template: the optional system prompt, then
    ``text`` as the user message."""
    messages = []
    if prompt_spec.system_prompt:
        messages.append({"role": "system", "content": prompt_spec.system_prompt})
    messages.append({"role": "user", "content": text})
    return messages
