"""How a step's training rows are cut into micro-batches.

Right-padded micro-batches cost ``rows x longest row`` tokens of compute; mixing short and long rows
wastes the difference. With a token budget (``trainer.max_tokens_per_micro_batch``) rows are sorted by
length and packed greedily so that every micro-batch's padded size stays within the budget: similar
lengths share a micro-batch and padding nearly vanishes. Without one, micro-batches are
``trainer.micro_batch_size`` consecutive rows (rows come sorted by slot). The per-adapter loss is
normalised over the whole step either way, so the grouping changes speed, not the update (up to
floating-point summation order).
"""

from __future__ import annotations


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch, for rows of ``lengths`` tokens.

    ``max_tokens > 0``: longest rows first, each micro-batch at most ``max_rows`` rows and
    ``rows x longest <= max_tokens`` (a row longer than the budget goes alone). Otherwise
    consecutive groups of ``max_rows``. Deterministic.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    order = list(range(len(lengths)))
    if max_tokens <= 0:
        return [order[i : i + max_rows] for i in range(0, len(order), max_rows)]
    order.sort(key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]  # rows arrive longest first
        if current and (len(current) >= max_rows or longest * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    """Tokens the right-padded micro-batches compute (rows x longest, summed)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)
