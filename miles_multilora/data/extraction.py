"""Pulling the final answer out of a completion or a reference solution."""

from __future__ import annotations

import re

NUMBER_PATTERN = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
HASH_PATTERN = re.compile(r"####\s*([^\n]*)")


def extract_tagged(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>`` in ``text`` (stripped), or ``None``."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_hash(text: str) -> str | None:
    """What follows the last ``####`` on its line (GSM8K style), or ``None``."""
    matches = HASH_PATTERN.findall(text)
    return matches[-1].strip() if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234`` and ``$5`` allowed), or ``None``."""
    matches = NUMBER_PATTERN.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str, rule: str) -> str | None:
    """Answer in ``text`` per ``rule``: ``hash`` | ``boxed`` | ``last_number`` | ``none`` (whole text)."""
    if rule == "hash":
        return extract_hash(text)
    if rule == "boxed":
        return extract_boxed(text)
    if rule == "last_number":
        return extract_last_number(text)
    if rule == "none":
        return text.strip()
    raise ValueError(f"unknown extraction rule {rule!r}; use hash, boxed, last_number or none")


def reference_answer(answer: str) -> str:
    """The final answer of a reference solution: after ``####`` or inside ``\\boxed{}`` when present."""
    return extract_hash(answer) or extract_boxed(answer) or answer.strip()


def normalize_answer(text: str | None) -> str | None:
    """Canonical form for exact matching: trimmed, case-folded; numbers lose ``$``, ``,`` and ``.0``."""
    if text is None:
        return None
    s = text.strip().rstrip(".").strip()
    candidate = s.replace(",", "").replace("$", "").strip()
    try:
        value = float(candidate)
    except ValueError:
        return " ".join(s.split()).casefold()
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)
