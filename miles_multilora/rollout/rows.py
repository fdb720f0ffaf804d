"""The host's view of the embedded engine's work: prompt groups waiting for rows, rows in the batch
(or preempted, waiting to resume), and the page arithmetic of both.

A row holds its prompt's pages (the full ones shared with its group, reference-counted by the
cache) and the pages it has filled; it takes the pages for its next decode steps at each host
check (:func:`pages_ahead`). Token ``i`` of a row (prompt then output) lives in its page
``i // page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // page_size)


@dataclass
class Group:
    """Requests sharing one prompt prefill: same adapter, slot, version and prompt."""

    slot: int
    prompt: list[int]
    members: list[int]  # request indices


@dataclass
class Row:
    """One sample: in the batch (its state on the device), or preempted (its outputs kept here)."""

    request: int
    pages: list[int]  # every page this row holds (shared prompt pages included)
    prompt_len: int
    budget: int  # output tokens it may produce
    stops: list[str]
    stop_ids: frozenset[int]  # token ids that end the sample (kept as its last output)
    filtered: bool  # samples from a top-k / top-p filtered distribution
    admitted: int  # admission order of its first admission: preemption takes the latest first
    count: int = 1  # output tokens as of the last host check
    checked: int = 0  # output tokens already scanned for stop strings and stop token ids
    stop_at: int | None = None  # output length when a stop string or stop token completed
    # while preempted: the outputs so far (the last one sampled, not yet fed to the model)
    saved_tokens: list[int] = field(default_factory=list)
    saved_logprobs: list[float] = field(default_factory=list)
    # (first output index, adapter version) of each run of outputs sampled with one version
    versions: list[tuple[int, int]] = field(default_factory=list)

    def token_versions(self, n: int) -> list[int]:
        """The adapter version that sampled each of the first ``n`` outputs."""
        out: list[int] = []
        ends = [start for start, _ in self.versions[1:]] + [n]
        for (_, version), end in zip(self.versions, ends, strict=True):
            out += [version] * max(0, min(end, n) - len(out))
        return out

    def pages_ahead(self, steps: int, page_size: int) -> int:
        """Pages it must hold before ``steps`` more decode steps: the next step writes the K/V of
        its last output at ``prompt_len + count - 1``, and its last possible step (output
        ``budget - 1`` sampled) at ``prompt_len + budget - 2``."""
        tokens = min(self.prompt_len + self.count - 1 + steps, self.prompt_len + self.budget - 1)
        return pages_for(tokens, page_size)

    def resume_tokens(self, prompt: list[int]) -> list[int]:
        """What a preempted row prefills to return: its prompt and every output but the last (which
        the next decode step feeds, as it would have without the preemption)."""
        return prompt + self.saved_tokens[: self.count - 1]


def group_admission_pages(prompt_len: int, members: int, page_size: int) -> int:
    """Pages a group takes when admitted: its prompt's full pages once, and each member's copy of
    the partial last page."""
    return prompt_len // page_size + (members if prompt_len % page_size else 0)
