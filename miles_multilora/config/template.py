"""Prompt templates: literal text with plain ``{field}`` placeholders, nothing else.

``str.format`` would also run format specs (``{question:>100000000}`` builds a 100-million
character string per row), conversions (``{question!r}``) and attribute or index access
(``{question.__class__.__mro__}``, ``{question[0]}``): a template is data, so only a column name
between braces is a placeholder. ``{{`` and ``}}`` stand for literal braces.
"""

from __future__ import annotations

import re
import string
from functools import lru_cache

from miles_multilora.errors import SpecError

FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Piece = tuple[str, str | None]  # (literal text, field name or None)


@lru_cache(maxsize=256)
def parse_template(template: str, key: str = "prompt.template") -> tuple[Piece, ...]:
    """The ``(literal, field)`` pieces of ``template``.

    Raises :class:`SpecError` on ``key``, naming the first placeholder that is not a plain
    ``{field}`` (or the syntax error: an unmatched brace).
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SpecError(
            key, f"is not a valid template ({exc}); write literal braces as {{{{ and }}}}"
        ) from exc
    pieces: list[Piece] = []
    for literal, field, spec, conversion in parsed:
        if field is None:
            pieces.append((literal, None))
            continue
        if conversion is not None or spec or not FIELD_NAME.match(field):
            shown = (
                "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            )
            raise SpecError(
                key,
                f"placeholder {shown} is not allowed: use plain {{field}} placeholders naming a dataset column "
                "(no format spec, width or precision, no !r/!s/!a conversion, no attribute or index access)",
            )
        pieces.append((literal, field))
    return tuple(pieces)
