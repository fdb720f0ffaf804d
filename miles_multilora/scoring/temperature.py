"""Token log-probabilities at a sampling temperature.

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
