"""Recompute per-token logprobs of given sequences with a full forward (no KV cache).

The trainer uses :func:`sequence_logprobs` for its training logprobs too, so nothing here runs under
``no_grad``: callers decide. Each sequence is routed to its own LoRA slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from miles_multilora.rollout.routing import check_servable_slots, per_sequence_slots, slot_routing
from miles_multilora.rollout.sampling import token_logprobs


def right_pad(
    sequences: Sequence[Sequence[int]], pad_id: int = 0, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Stack token lists into ``input_ids [B, S]`` (right-padded with ``pad_id``) and ``lengths [B]``."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("right_pad needs at least one sequence and no empty sequence")
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=device)
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long, device=device)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long, device=device)
    return ids, lengths


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Megatron-style boolean attention mask ``[1, 1, S, S]`` (True = masked out)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1).view(1, 1, seq_len, seq_len)


def forward_logits(model: torch.nn.Module, input_ids: Tensor, slots: Tensor | Sequence[int]) -> Tensor:
    """Full causal forward of right-padded ``input_ids [B, S]``; returns logits ``[B, S, V]``."""
    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len, device=input_ids.device).view(1, -1).expand(batch, -1)
    slot_list = slots.tolist() if isinstance(slots, Tensor) else list(slots)
    routed = check_servable_slots(model, slot_list)
    slot_ids = per_sequence_slots(slot_list, seq_len, input_ids.device)
    with slot_routing(model, slot_ids, routed):
        return model(
            input_ids, position_ids, causal_mask(seq_len, input_ids.device), runtime_gather_output=True
        )


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    slots: Tensor | Sequence[int],
    temperatures: Tensor | Sequence[float] | float = 1.0,
    vocab_size: int | None = None,
) -> Tensor:
    """``out[b, t]`` = logprob of ``input_ids[b, t + 1]`` given its prefix, shape ``[B, S - 1]``.

    Temperatures are per sequence (0 = greedy, taken as 1), as in the rollout engine. Positions past
    a sequence's length hold garbage: mask them with the lengths.
    """
    logits = forward_logits(model, input_ids, slots)
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device)
    if temps.dim() == 1:
        temps = temps.view(-1, 1)
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temps, vocab_size)


def compute_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    slots: Sequence[int],
    temperatures: Sequence[float] | float = 1.0,
    vocab_size: int | None = None,
    pad_id: int = 0,
) -> list[Tensor]:
    """Per-token logprobs of each full sequence (prompt + completion): ``len(seq) - 1`` values each,
    the i-th being the logprob of ``seq[i + 1]``. Slice ``[len(prompt) - 1:]`` for the completion."""
    if len(slots) != len(sequences):
        raise ValueError(f"got {len(sequences)} sequences but {len(slots)} slots")
    device = next(model.parameters()).device
    input_ids, lengths = right_pad(sequences, pad_id, device)
    out = sequence_logprobs(model, input_ids, slots, temperatures, vocab_size)
    return [out[i, : int(n) - 1] for i, n in enumerate(lengths)]
