"""DAPO overlong reward shaping: a soft linear penalty near the generation limit."""

from __future__ import annotations


def overlong_penalty(
    response_length: int, max_new_tokens: int, buffer_len: int, factor: float = 1.0
) -> float:
    """Penalty (<= 0) for a response of ``response_length`` tokens.

    0 up to ``max_new_tokens - buffer_len`` tokens, then falling linearly to ``-factor`` at
    ``max_new_tokens`` (and staying there beyond). ``buffer_len=0`` disables shaping.
    """
    if buffer_len <= 0:
        return 0.0
    if buffer_len > max_new_tokens:
        raise ValueError(f"overlong buffer_len {buffer_len} exceeds max_new_tokens {max_new_tokens}")
    exceed = response_length - (max_new_tokens - buffer_len)
    if exceed <= 0:
        return 0.0
    return -min(exceed, buffer_len) / buffer_len * factor
