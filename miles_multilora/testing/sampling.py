"""The host-side reference sampler: seeded per-request draws with temperature, top-k and top-p.

The engines sample on the device (:mod:`miles_multilora.rollout.device_sampling`); this is the
semantics they implement, checked against in the tests, and the sampler of the baseline engine
that ``benchmarks/rollout.py`` measures side by side.
"""

from __future__ import annotations

import torch
from torch import Tensor


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf every logit of a 1-D ``logits`` outside the top-k and the top-p nucleus."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token is always kept (mass_before == 0)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(
    logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """Pick the next token from 1-D ``logits``: argmax when ``temperature == 0`` or ``top_k == 1``,
    otherwise a draw from the filtered, tempered distribution using ``generator``."""
    if temperature == 0 or top_k == 1:
        return int(torch.argmax(logits))
    scaled = filter_top_k_top_p(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator owned by one request, so its draws do not depend on the rest of the batch."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen
