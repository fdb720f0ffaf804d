"""Recompute per-token logprobs of given sequences with a full forward (no KV cache).

The trainer uses :func:`selected_logprobs` for its training logprobs (the response positions only,
through a chunked LM head: no fp32 ``[tokens, vocab]`` logits), and rollout parity checks use
:func:`sequence_logprobs`; nothing here runs under ``no_grad``: callers decide. Each sequence is
routed to its own LoRA slot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from miles_multilora.host_tensors import tensor_on, to_device
from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.models.provider import gpt_module
from miles_multilora.scoring.chunked_logprobs import (
    DEFAULT_CHUNK_ROWS,
    chunked_token_logprobs,
    chunked_topk_logprobs,
)
from miles_multilora.scoring.routing import check_servable_slots, row_routing
from miles_multilora.scoring.temperature import effective_temperature, token_logprobs

if TYPE_CHECKING:
    from miles_multilora.models.packed_rows import PackedRows


def right_pad(
    sequences: Sequence[Sequence[int]], pad_id: int = 0, device: torch.device | str = "cpu", width: int = 0
) -> tuple[Tensor, Tensor]:
    """Stack token lists into ``input_ids [B, S]`` (right-padded with ``pad_id``; ``S`` at least
    ``width``) and ``lengths [B]``."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("right_pad needs at least one sequence and no empty sequence")
    lengths = [len(s) for s in sequences]
    ids = torch.full((len(sequences), max(*lengths, width)), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):  # on the host, then one copy (a copy per row waits per row)
        ids[i, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return to_device(ids, device), tensor_on(lengths, device, torch.long)


def forward_logits(model: torch.nn.Module, input_ids: Tensor, slots: Tensor | Sequence[int]) -> Tensor:
    """Full causal forward of right-padded ``input_ids [B, S]``; returns logits ``[B, S, V]``."""
    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len, device=input_ids.device).view(1, -1).expand(batch, -1)
    slot_list = slots.tolist() if isinstance(slots, Tensor) else list(slots)
    routed = check_servable_slots(model, slot_list)
    with row_routing(model, slot_list, seq_len, input_ids.device, routed):
        return model(input_ids, position_ids, None, runtime_gather_output=True)  # causal


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


@contextmanager
def _hidden_states_only(gpt: Any) -> Iterator[None]:
    """Make ``gpt``'s forward return the final hidden states (after the last norm, before the LM head)."""
    saved = gpt.post_process
    gpt.post_process = False  # GPTModel.forward returns the decoder output when not post-processing
    try:
        yield
    finally:
        gpt.post_process = saved


def lm_head_weight(model: torch.nn.Module) -> Tensor | None:
    """This rank's LM-head weight shard ``[V_local, H]``, or None when the chunked path cannot serve the
    head (a LoRA-adapted or biased output layer needs the module's own forward)."""
    gpt = gpt_module(model)
    head = gpt.output_layer
    if isinstance(head, MultiLoRALinear) or getattr(head, "bias", None) is not None:
        return None
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else head.weight


def selected_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    slots: Tensor | Sequence[int],
    temperatures: Tensor | Sequence[float],
    vocab_size: int,
    rows: Tensor,
    positions: Tensor,
    chunk: int = DEFAULT_CHUNK_ROWS,
    route: bool = True,
    targets: Tensor | None = None,
    packed: PackedRows | None = None,
) -> Tensor:
    """Logprobs of ``input_ids[rows[i], positions[i] + 1]`` given its prefix, for the selected pairs only.

    ``input_ids`` ``[B, S]`` right-padded; ``temperatures`` per sequence (0 = greedy, taken as 1).
    The LM head runs on the selected hidden states only, in chunks of ``chunk`` rows, so neither the
    prompt positions' logits nor an fp32 ``[tokens, vocab]`` tensor exist. Differentiable.
    ``targets``: the token scored at each pair instead of the next input token.
    ``route=False``: the caller has routed the model's tokens already (and keeps that routing through
    the backward, which activation recompute needs: it runs the forward again there).
    ``packed``: ``input_ids`` is ``[1, T]``, the rows packed back to back as ``packed`` lays them out
    (``models.packed_rows``; the caller routes and holds the packed layout, ``route=False``);
    ``rows``/``positions`` still name a row and a position within it.
    """
    if packed is not None and route:
        raise ValueError("packed rows are routed by the caller: pass route=False")
    temps = to_device(torch.as_tensor(temperatures, dtype=torch.float32), input_ids.device)
    weight = lm_head_weight(model)
    if weight is None:  # the module's own LM head: full logits, then the selected entries
        if packed is not None:
            raise ValueError("packed rows need the chunked LM head (a LoRA or biased output layer pads)")
        if targets is not None and not bool((targets == input_ids[rows, positions + 1]).all()):
            raise ValueError("targets other than the next input token need the chunked LM head")
        return sequence_logprobs(model, input_ids, slots, temps, vocab_size)[rows, positions]
    at_rows, at = rows, positions
    if packed is not None:  # (row, position) -> (0, its token in the packed sequence)
        at_rows, at = torch.zeros_like(rows), packed.row_starts[rows] + positions
    if targets is None:
        targets = input_ids[at_rows, at + 1]
    hidden = _selected_hidden(model, input_ids, slots, at_rows, at, route, packed)
    return chunked_token_logprobs(
        hidden, weight, targets, effective_temperature(temps)[rows], vocab_size, chunk
    )


def _selected_hidden(
    model: torch.nn.Module, input_ids: Tensor, slots: Tensor | Sequence[int], rows: Tensor,
    positions: Tensor, route: bool, packed: PackedRows | None = None,
) -> Tensor:  # fmt: skip
    """``[N, H]``: the final hidden states (the LM head's input) at the selected pairs (``packed``:
    ``input_ids`` is one packed sequence, each token at its position within its row)."""
    gpt = gpt_module(model)
    batch, seq_len = input_ids.shape
    if packed is not None:
        position_ids = packed.positions.view(1, -1)
    else:
        position_ids = torch.arange(seq_len, device=input_ids.device).view(1, -1).expand(batch, -1)
    slot_list = slots.tolist() if isinstance(slots, Tensor) else list(slots)
    routed = route and check_servable_slots(model, slot_list)
    with row_routing(model, slot_list, seq_len, input_ids.device, routed):
        with _hidden_states_only(gpt):
            hidden = model(input_ids, position_ids, None)  # [S, B, H]; causal by the layers' mask type
    return hidden[positions, rows]


@torch.no_grad()
def selected_scores(
    model: torch.nn.Module,
    input_ids: Tensor,
    slots: Tensor | Sequence[int],
    vocab_size: int,
    rows: Tensor,
    positions: Tensor,
    k: int = 0,
    chunk: int = DEFAULT_CHUNK_ROWS,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """From one forward, at each selected pair: the logprob of ``input_ids[rows[i], positions[i] + 1]``
    (as :func:`selected_logprobs` at temperature 1) and, when ``k > 0``, the ``k`` most likely
    next tokens and their logprobs (``[N, k]`` each, highest first). fp32 log-softmax; no gradient."""
    targets = input_ids[rows, positions + 1]
    weight = lm_head_weight(model)
    if weight is None:  # the module's own LM head: full logits at the selected pairs
        logits = forward_logits(model, input_ids, slots)[rows, positions, :vocab_size]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if k <= 0:
            return picked, None, None
        values, ids = logprobs.topk(k, dim=-1)
        return picked, ids, values
    hidden = _selected_hidden(model, input_ids, slots, rows, positions, route=True)
    ones = torch.ones(hidden.shape[0], device=hidden.device)
    picked = chunked_token_logprobs(hidden, weight, targets, ones, vocab_size, chunk)
    if k <= 0:
        return picked, None, None
    ids, values = chunked_topk_logprobs(hidden, weight, ones, vocab_size, k, chunk)
    return picked, ids, values
