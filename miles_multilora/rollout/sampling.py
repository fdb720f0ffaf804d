"""Token log-probabilities and seeded per-request sampling (temperature, top-k, top-p).

The same :func:`token_logprobs` is used for rollout logprobs and for the trainer's recomputed
logprobs, so the two agree to the model's numerics.
"""

from __future__ import annotations

import torch
from torch import Tensor


def effective_temperature(temperature: Tensor | float) -> Tensor | float:
    """The temperature logprobs are taken at: the sampling temperature, or 1 for greedy (T == 0)."""
    if isinstance(temperature, Tensor):
        return torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return temperature if temperature > 0 else 1.0


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: Tensor | float = 1.0, vocab_size: int | None = None
) -> Tensor:
    """``log_softmax(logits / T)[target]`` over the full distribution of the first ``vocab_size`` ids.

    ``logits`` is ``[..., V]`` (``V`` may be a padded vocab larger than ``vocab_size``; the padding
    is excluded), ``targets`` is ``[...]``, ``temperature`` a float or a tensor broadcastable to
    ``targets`` (0 means greedy and counts as 1). Differentiable; computed in fp32.
    """
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    scaled = logits.float()
    temp = effective_temperature(temperature)
    if isinstance(temp, Tensor):
        scaled = scaled / temp.to(scaled).unsqueeze(-1)
    elif temp != 1.0:
        scaled = scaled / temp
    picked = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


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
