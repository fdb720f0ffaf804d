"""Forward/backward over mixed-slot rows with a pluggable loss, on one rank's model.

A row carries its slot, its tokens and the positions whose next token is scored; the loss sees
the logprobs at those positions (``[rows, width]``, zero-padded) and returns one scalar plus
per-slot metrics. :meth:`~miles_multilora.trainer.rank.TrainerRank.forward_backward` splits the
rows over data-parallel ranks and runs its share through :func:`forward_backward_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from miles_multilora.algo.device_metrics import read_together
from miles_multilora.config.sections.trainer import TrainerConfig
from miles_multilora.host_tensors import tensor_on, to_device
from miles_multilora.lora import token_slots
from miles_multilora.lora.inject import model_num_slots
from miles_multilora.lora.routing import packed_routing_plan, row_routing_plan
from miles_multilora.models import compat
from miles_multilora.models.packed_rows import PackedRows, pack_rows, packed_rows, packing_applies
from miles_multilora.rollout.expert_parallel import ExpertParallel
from miles_multilora.scoring.logprobs import lm_head_weight, right_pad, selected_logprobs, selected_scores
from miles_multilora.trainer.data_parallel import MAXED_METRICS
from miles_multilora.trainer.microbatch import micro_batches

SUMMED_METRICS = ("loss", "pg_loss")  # already normalised over the whole step: summed over micro-batches
COUNT_METRICS = ("num_tokens", "on_policy_tokens")  # token counts: summed, and the weights of the means


def weight_of(metric: str) -> str:
    """The token count a per-token mean is weighted by: ``on_policy_*`` means by the on-policy tokens."""
    return "on_policy_tokens" if metric.startswith("on_policy_") else "num_tokens"


@dataclass
class ScoredRow:
    """One sequence: its slot, tokens, and the positions ``p`` whose next token is scored.

    ``targets[j]`` is the token scored at ``positions[j]`` (default ``tokens[p + 1]``); ``values``
    holds per-position loss inputs (for example ``weights``, ``advantages``, ``logprobs``).
    ``temperature``: the sampling temperature the row's tokens came from (0 = greedy; scored at
    :func:`~miles_multilora.scoring.temperature.effective_temperature` of it)."""

    slot: int
    tokens: list[int]
    positions: list[int]
    targets: list[int] | None = None
    temperature: float = 1.0
    values: dict[str, list[float]] = field(default_factory=dict)
    tag: int = 0  # the caller's grouping (e.g. a request); loss functions may key metrics by it
    group: int | None = None  # rows of one group train on one DP rank (None: the row alone)

    @property
    def width(self) -> int:
        return len(self.positions)


@dataclass
class MicroBatch:
    """What a loss function sees: the rows, their scored logprobs ``[rows, width]`` (differentiable),
    the 0/1 ``mask`` of real positions, and (when asked for) the base model's logprobs."""

    rows: list[ScoredRow]
    logprobs: torch.Tensor
    mask: torch.Tensor
    reference: torch.Tensor | None = None

    def values(self, key: str, default: float = 0.0) -> torch.Tensor:
        """``[rows, width]`` of per-position input ``key`` (zero-padded)."""
        out = torch.full(tuple(self.mask.shape), default, dtype=torch.float32)
        for i, r in enumerate(self.rows):
            data = r.values.get(key)
            if data is not None:
                out[i, : len(data)] = torch.tensor(data[: r.width], dtype=torch.float32)
        return to_device(out, self.mask.device)

    @property
    def slots(self) -> torch.Tensor:
        return torch.tensor([r.slot for r in self.rows])


class LossFn(Protocol):
    def __call__(self, batch: MicroBatch) -> tuple[torch.Tensor, dict[int, dict[str, float]]]:
        """The scalar to backpropagate and per-slot metrics (``num_tokens`` weights the others)."""
        ...


@dataclass
class ForwardBackwardResult:
    """Per-row logprobs at their positions (input order; empty unless asked for), per-slot (or
    per-tag) metric sums, and the tokens of the rows this rank ran."""

    logprobs: list[list[float]]
    per_slot: dict[int, dict[str, float]]
    local_tokens: int = 0


def row_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    rows: Sequence[ScoredRow],
    slots: list[int],
    vocab_size: int,
    chunk_tokens: int,
    route: bool = True,
    packed: PackedRows | None = None,
) -> torch.Tensor:
    """``[len(rows), width]``: each row's logprobs at its positions (zero-padded), through the
    chunked LM head on those positions only. Differentiable. ``packed``: ``input_ids`` holds the rows
    packed into one sequence (the caller routes them and holds the layout)."""
    device = input_ids.device
    row_index = tensor_on([i for i, r in enumerate(rows) for _ in r.positions], device)
    offset = tensor_on([j for r in rows for j in range(r.width)], device)
    positions = tensor_on([p for r in rows for p in r.positions], device)
    targets = None
    if any(r.targets is not None for r in rows):
        targets = tensor_on(
            [t for r in rows for t in (r.targets or [r.tokens[p + 1] for p in r.positions])], device
        )
    lp = selected_logprobs(
        model, input_ids, slots, [r.temperature for r in rows], vocab_size, row_index,
        positions, chunk_tokens, route=route, targets=targets, packed=packed,
    )  # fmt: skip
    out = lp.new_zeros(len(rows), max((r.width for r in rows), default=0))
    out[row_index, offset] = lp
    return out


def _slot_micro_batches(
    rows: Sequence[ScoredRow], indices: Iterable[int], settings: TrainerConfig
) -> Iterator[tuple[list[int], list[ScoredRow]]]:
    """``rows[indices]`` sorted by slot, in micro-batches by ``settings``' row and token budgets:
    each batch's row indices and rows."""
    order = sorted(indices, key=lambda i: rows[i].slot)
    if not order:
        return
    lengths = [len(rows[i].tokens) for i in order]
    for index in micro_batches(lengths, settings.micro_batch_size, settings.max_tokens_per_micro_batch):
        picked = [order[i] for i in index]
        yield picked, [rows[i] for i in picked]


def _lockstep_batches(
    batches: list[tuple[list[int], list[ScoredRow]]], lockstep: bool, pad_id: int
) -> list[tuple[list[int], list[ScoredRow]]]:
    """``batches``, and with ``lockstep`` filler micro-batches (one 2-token row of slot 0, no picked
    rows) up to the most any rank runs: expert-parallel MoE layers exchange tokens with the other
    ranks at every forward and backward, so every rank runs as many (a rank with no rows too)."""
    if not lockstep:
        return batches
    count = torch.tensor([len(batches)], dtype=torch.long, device=compat.default_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    filler = ScoredRow(slot=0, tokens=[pad_id, pad_id], positions=[0])
    return batches + [([], [filler])] * (int(count.item()) - len(batches))


def _gathering(model: torch.nn.Module, lockstep: bool) -> ExpertParallel | None:
    """With ``lockstep``, the EP group of ``model`` when its MoE layers use Megatron's all-gather
    token dispatcher (it gathers as many tokens from every EP rank, without split sizes), else None."""
    ep = ExpertParallel.of_model(model, compat.default_device()) if lockstep else None
    return ep if ep is not None and ep.equal_tokens else None


def _padded(batch: list[ScoredRow], ep: ExpertParallel | None, pad_id: int) -> tuple[list[ScoredRow], int]:
    """``batch`` and its width; with ``ep`` (:func:`_gathering`) one-token rows of no positions (the
    last row's slot, so the rows stay sorted by slot) up to the most rows of an EP rank's micro-batch,
    and the widest of their rows: every EP rank runs a ``[rows, width]`` forward of the same shape.
    The padding scores nothing, so it adds exact zeros to the gradients (tokens do not mix in a MoE
    layer, and the right-padding columns come after every real token)."""
    width = max(len(r.tokens) for r in batch)
    if ep is None:
        return batch, width
    rows, width = ep.agree([len(batch), width])
    pad = ScoredRow(slot=batch[-1].slot, tokens=[pad_id], positions=[], temperature=batch[-1].temperature)
    return batch + [pad] * (rows - len(batch)), width


@contextmanager
def _routed(
    model: torch.nn.Module, slots: list[int], packed: PackedRows | None, ids: torch.Tensor
) -> Iterator[None]:
    """``model`` routed for the rows of ``ids`` (row ``i`` to ``slots[i]``), in the packed layout
    when ``packed``."""
    if packed is None:
        with token_slots(model, row_routing_plan(slots, ids.shape[1], model_num_slots(model), ids.device)):
            yield
        return
    plan = packed_routing_plan(slots, packed.lengths, model_num_slots(model), ids.device)
    with token_slots(model, plan), packed_rows(model, packed):
        yield


def forward_backward_rows(
    model: torch.nn.Module,
    rows: Sequence[ScoredRow],
    loss_fn: LossFn,
    settings: TrainerConfig,
    pad_id: int,
    vocab_size: int,
    *,
    backward: bool = True,
    reference: bool = False,
    return_logprobs: bool = True,
    lockstep: bool = False,
) -> ForwardBackwardResult:
    """Score ``rows`` in micro-batches (by ``settings``' row and token budgets) with each row's slot
    routed, and evaluate ``loss_fn`` on each; with ``backward`` backpropagate it (gradients
    accumulate in the slots), else only its metrics are kept (no graph). ``reference`` also
    computes the base model's logprobs (slot -1, no grad) for the loss. The per-row logprobs are
    copied to the host once, at the end, when ``return_logprobs``. ``lockstep``: every rank runs as
    many micro-batches (expert parallelism; fillers add exact zeros to the gradients)."""
    chunk = settings.logprob_chunk_tokens
    kept: list[tuple[list[int], torch.Tensor]] = []
    per_slot: dict[int, dict[str, float]] = {}
    batch_metrics: list[Mapping[int, dict[str, float]]] = []
    model.train(backward)
    # packed rows need the chunked LM head too (a LoRA or biased output layer scores padded rows)
    pack = settings.pack_rows and packing_applies(model) and lm_head_weight(model) is not None
    device = compat.default_device()
    batches = _lockstep_batches(list(_slot_micro_batches(rows, range(len(rows)), settings)), lockstep, pad_id)
    gathering = _gathering(model, lockstep)
    for picked, batch in batches:
        padded, pad_width = _padded(batch, gathering, pad_id)
        tokens = [r.tokens for r in padded]
        packed = None
        if pack:
            input_ids, packed = pack_rows(tokens, device, attention=settings.attention)
        else:
            input_ids, _ = right_pad(tokens, pad_id, device, pad_width)
        slots = [r.slot for r in padded]
        width = max(r.width for r in batch)
        mask = torch.zeros(len(batch), width)
        for i, r in enumerate(batch):
            mask[i, : r.width] = 1
        mask = to_device(mask, input_ids.device)
        ref = None
        if reference:
            with torch.no_grad(), _routed(model, [-1] * len(padded), packed, input_ids):
                ref = row_logprobs(
                    model, input_ids, padded, [-1] * len(padded), vocab_size, chunk, False, packed
                )[: len(batch)]
        # routing (and the packed layout) kept through the backward: activation recompute runs the
        # forward again there
        with _routed(model, slots, packed, input_ids), torch.set_grad_enabled(backward):
            lp = row_logprobs(model, input_ids, padded, slots, vocab_size, chunk, False, packed)[: len(batch)]
            if not picked:  # a lockstep filler: the same passes, no loss, no metrics
                if backward:
                    (lp.sum() * 0.0).backward()
                continue
            loss, metrics = loss_fn(MicroBatch(batch, lp, mask, ref))
            if backward:
                loss.backward()
        batch_metrics.append(metrics)
        if return_logprobs:
            kept.append((picked, lp.detach()))
    read_together(batch_metrics)  # the metrics of every micro-batch with one wait for the GPU
    for metrics in batch_metrics:
        accumulate_metrics(per_slot, metrics)
    logprobs: list[list[float]] = [[] for _ in rows]
    if kept:  # every micro-batch's logprobs read with one wait
        flat = torch.cat([lp.float().reshape(-1) for _, lp in kept]).cpu().tolist()
        start = 0
        for picked, lp in kept:
            width = lp.shape[1]
            for j, i in enumerate(picked):
                logprobs[i] = flat[start + j * width : start + j * width + rows[i].width]
            start += lp.numel()
    return ForwardBackwardResult(logprobs, per_slot, sum(len(r.tokens) for r in rows))


@dataclass
class RowScores:
    """One row's logprobs at its positions and, when asked for, the ``k`` most likely next tokens
    at each (ids and logprobs, highest first)."""

    logprobs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


def score_rows(
    model: torch.nn.Module,
    rows: Sequence[ScoredRow],
    settings: TrainerConfig,
    pad_id: int,
    vocab_size: int,
    k: int = 0,
    lockstep: bool = False,
) -> list[RowScores]:
    """Score ``rows`` in micro-batches (as :func:`forward_backward_rows`, each row's slot routed,
    slot -1 the base model): the logprob of the next input token at each position, at temperature
    1, and with ``k > 0`` the ``k`` most likely next tokens there. No gradient, no loss.
    ``lockstep``: every rank runs as many micro-batches (expert parallelism)."""
    if any(r.targets is not None for r in rows):
        raise ValueError("score_rows scores the next input token: rows must not carry targets")
    out = [RowScores([], [] if k > 0 else None, [] if k > 0 else None) for _ in rows]  # rows of no positions
    live = [i for i, r in enumerate(rows) if r.width]
    model.train(False)
    gathering = _gathering(model, lockstep)
    for picked, batch in _lockstep_batches(list(_slot_micro_batches(rows, live, settings)), lockstep, pad_id):
        padded, pad_width = _padded(batch, gathering, pad_id)
        input_ids, _ = right_pad([r.tokens for r in padded], pad_id, compat.default_device(), pad_width)
        device = input_ids.device
        row_index = tensor_on([i for i, r in enumerate(batch) for _ in r.positions], device)
        positions = tensor_on([p for r in batch for p in r.positions], device)
        lp, ids, values = selected_scores(
            model, input_ids, [r.slot for r in padded], vocab_size, row_index, positions, k,
            settings.logprob_chunk_tokens,
        )  # fmt: skip
        if not picked:  # a lockstep filler
            continue
        lp_host = lp.float().cpu().tolist()
        ids_host = ids.cpu().tolist() if ids is not None else None
        values_host = values.float().cpu().tolist() if values is not None else None
        start = 0
        for i, r in zip(picked, batch, strict=True):
            end = start + r.width
            out[i] = RowScores(
                lp_host[start:end],
                ids_host[start:end] if ids_host is not None else None,
                values_host[start:end] if values_host is not None else None,
            )
            start = end
    return out


def accumulate_metrics(acc_all: dict[int, dict[str, float]], metrics: dict[int, dict[str, float]]) -> None:
    """Add one micro-batch's per-slot metrics to the sums ``acc_all`` (see :func:`finish_metrics`)."""
    for slot, m in metrics.items():
        acc = acc_all.setdefault(int(slot), {"num_tokens": 0.0})
        for k, v in m.items():
            if k in SUMMED_METRICS or k in COUNT_METRICS:
                acc[k] = acc.get(k, 0.0) + float(v)
            elif k in MAXED_METRICS:
                acc[k] = max(acc.get(k, 0.0), float(v))
            else:  # token means of this micro-batch: weight by their tokens
                acc[f"_w_{k}"] = acc.get(f"_w_{k}", 0.0) + float(v) * float(m.get(weight_of(k), 0.0))


def finish_metrics(acc: dict[str, float]) -> dict[str, float]:
    """Metric sums of one slot -> values: token-weighted means divided out, sums kept."""
    return {
        k[3:] if k.startswith("_w_") else k: (
            v / max(acc.get(weight_of(k[3:]), 0.0), 1e-9) if k.startswith("_w_") else v
        )
        for k, v in acc.items()
    }
