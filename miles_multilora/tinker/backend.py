"""Tinker-style training on the resident slots: each client model holds a slot of one trainer rank.

:class:`TinkerBackend` maps model ids to slots and turns each operation into the rank's primitives
(:class:`~miles_multilora.trainer.rank.TrainerRank`): the slot's LoRA shape, seed and weight
version are the rank's. The forward/backward requests of several models run as *one* mixed-slot
batch; each model's gradient is what it would get alone (its loss is a sum over its own tokens and
its LoRA weights are its own). :meth:`TinkerBackend.check` validates a request before it joins a
batch, so a bad one fails alone; :mod:`~miles_multilora.tinker.scheduler` runs the operations.

Models are not limited to the slots: when an operation needs a model that is not resident and no
slot is free, the least recently used resident model is parked (its whole state, unapplied
gradients included, to host memory, and past ``offload_host_bytes`` of parked state on to disk;
:mod:`~miles_multilora.trainer.offload`) and the model comes back into the freed slot exactly as it
was. Only ``max_models`` bounds how many a server holds (and, per tenant, the server state's
``tinker.max_models_per_tenant``).

Besides the client models, a slot may hold a **sampling copy**: saved sampler weights loaded for
sampling only (:meth:`TinkerBackend.load_copy`, :mod:`~miles_multilora.tinker.sampler_weights`).
It is evicted, never parked (its weights are on disk), by the same least-recently-used choice.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, KeysView, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec, check_sampling_vocab
from miles_multilora.errors import SpecError
from miles_multilora.lora.targets import ATTN, MLP, UNEMBED
from miles_multilora.rollout import GenerationRequest, GenerationResult, RolloutError
from miles_multilora.rollout.engine import unservable_sampling
from miles_multilora.tinker.losses import LOSS_INPUTS, TOPK_LOSSES, check_input, check_loss, tinker_loss
from miles_multilora.trainer.offload import ParkedSlot, park, spill_over_budget, unpark
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import OpenSlot, RankPrimitives
from miles_multilora.trainer.shard import SlotMeta, read_shard, shard_meta

LORA_ALPHA = 32.0  # Tinker's LoRA scale convention: alpha 32 at any rank


_SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop", "stop": "stop"}


def sampling_params_key(key: str) -> str:
    """A sampling field as a sample request names it: ``sampling.max_new_tokens`` (or
    ``max_new_tokens``, ``stop[2]``) -> ``sampling_params.max_tokens`` (``sampling_params.stop``)."""
    name = key.removeprefix("sampling.")
    field = name.split("[")[0]
    return "sampling_params." + _SAMPLING_NAMES.get(field, name)


class TinkerError(SpecError):
    """A request the backend refuses (unknown model, no free slot, malformed datum, ...)."""


Values = Sequence[float] | np.ndarray


@dataclass
class Datum:
    """One sequence of a forward/backward request: its input tokens and per-position loss inputs
    (``target_tokens`` plus the loss's own, each as long as the input); lists or 1-D arrays."""

    tokens: Sequence[int] | np.ndarray
    inputs: dict[str, Values]

    @property
    def targets_per_token(self) -> int:
        """K of ``[N, K]`` target_tokens (top-k distillation), else 1."""
        shape = np.shape(self.inputs.get("target_tokens", ()))
        return int(shape[1]) if len(shape) == 2 else 1

    @property
    def scored_tokens(self) -> int:
        """Token positions the forward scores (K per input token for ``[N, K]`` targets): its cost."""
        return len(self.tokens) * self.targets_per_token


def _ints(values: Sequence[int] | np.ndarray) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


def _floats(values: Values) -> list[float]:
    return (
        values.astype(np.float64).tolist() if isinstance(values, np.ndarray) else [float(v) for v in values]
    )


def _token_ids(values: Values, where: str, vocab_size: int) -> None:
    """Refuse anything but whole token ids in ``0 .. vocab_size - 1`` (a float id must be whole)."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise TinkerError(where, "must be a 1-D list of token ids") from exc
    if array.dtype.kind not in "iuf" or array.ndim != 1:
        raise TinkerError(where, "must be a 1-D list of token ids")
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            i = int(np.argmax(bad))
            raise TinkerError(
                where, f"token ids must be whole numbers; got {float(array[i]):g} at position {i}"
            )
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise TinkerError(where, f"token ids must be in 0..{vocab_size - 1}")


def _topk_width(loss: str, d: Datum, where: str) -> int:
    """K when the datum's targets are ``[N, K]`` (top-k distillation: ``cross_entropy`` only, its
    ``weights`` of the same shape), else 0; a clear error for any other shape."""
    shapes = {key: np.shape(d.inputs[key]) for key in LOSS_INPUTS[loss] if key in d.inputs}
    target = shapes.get("target_tokens", ())
    if len(target) != 2:
        return 0
    if loss not in TOPK_LOSSES:
        raise TinkerError(
            f"{where}.target_tokens",
            f"is [N, K] (top-k distillation), which only {', '.join(sorted(TOPK_LOSSES))} takes; {loss} needs [N]",
        )
    for key, shape in shapes.items():
        if shape != target:
            raise TinkerError(
                f"{where}.{key}", f"must have target_tokens' shape {list(target)}, got {list(shape)}"
            )
    if target[1] < 1:
        raise TinkerError(f"{where}.target_tokens", "is [N, 0]: give at least one target per position")
    return int(target[1])


def _finite(values: Values, where: str) -> None:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TinkerError(where, "must be a 1-D list of numbers") from exc
    bad = ~np.isfinite(array)
    if array.ndim != 1 or bad.any():
        i = int(np.argmax(bad)) if array.ndim == 1 else 0
        raise TinkerError(where, f"must be finite numbers; got {float(array.flat[i])} at position {i}")


@dataclass
class ForwardBackwardRequest:
    model_id: str
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False


@dataclass
class ForwardBackwardOutput:
    logprobs: list[list[float]] | list[list[list[float]]]  # per datum, shaped as its target_tokens
    metrics: dict[str, float]  # Tinker's "name:reduction" keys


@dataclass(frozen=True)
class PromptScoring:
    """What a sample request asks of its prompt: its logprobs (``logprobs``), the ``topk`` most
    likely tokens at each position (0: none), scored over the last ``last_n`` tokens (None: all)."""

    logprobs: bool = False
    topk: int = 0
    last_n: int | None = None


@dataclass
class PromptScores:
    """A prompt scored from position ``first`` on (positions before it, the first token at least,
    are not scored): ``logprobs[j]`` is log p(prompt[first + j] | prompt[:first + j]) (None when not
    asked for); ``topk_ids[j]`` / ``topk_logprobs[j]`` the most likely tokens there, highest first."""

    first: int
    length: int
    logprobs: list[float] | None
    k: int = 0
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class SampleRequest:
    """``num_samples`` completions of ``prompt`` from a model's live slot (``model_id`` None: the
    base model); sample ``j`` is seeded ``seed + j``."""

    model_id: str | None
    prompt: list[int]
    num_samples: int
    sampling: SamplingSpec
    seed: int = 0


SampleOutcome = list[GenerationResult] | Exception  # a request's samples, or why it was refused


class SampleJoiner(Protocol):
    """Sample requests that may join a running engine call (the server's queue)."""

    def waiting(self) -> bool:
        """Whether requests are waiting to join (asked at every host check: cheap)."""
        ...

    def take(self) -> Sequence[SampleRequest]:
        """The requests that join now (possibly none)."""
        ...


class _Joiner:
    """The rank's :class:`~miles_multilora.trainer.rank.GroupJoiner` for :meth:`TinkerBackend.sample_many`:
    each joining request's model gets its slot (never moving a model with rows in flight), and its
    group is numbered on after the call's others."""

    def __init__(
        self,
        backend: TinkerBackend,
        more: SampleJoiner,
        outcomes: list[SampleOutcome | None],
        where: list[int],
        done: Callable[[int, SampleOutcome], None],
    ) -> None:
        self.backend, self.more, self.outcomes, self.where, self.done = backend, more, outcomes, where, done

    def waiting(self) -> bool:
        return self.more.waiting()

    def join(self) -> list[list[GenerationRequest]]:
        groups = []
        for request in self.more.take():
            i = len(self.outcomes)
            self.outcomes.append(None)
            decoding = self.backend._decoding
            try:
                groups.append(self.backend._generation_requests(request, decoding))
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                self.done(i, exc)
                continue
            if request.model_id is not None:
                decoding.add(request.model_id)
            self.where.append(i)
        return groups


@dataclass
class SampleOutput:
    """A sample request's answer: its sequences, and its prompt's scores when asked for."""

    sequences: list[GenerationResult]
    prompt: PromptScores | None = None


class TinkerBackend:
    """The client models of one trainer rank (built without adapters): model id -> its slot, or
    its parked state when it is not resident."""

    def __init__(
        self,
        rank: RankPrimitives,
        *,
        max_models: int = 1024,
        offload_host_bytes: int = 16 << 30,
        offload_dir: str | Path | None = None,
    ) -> None:
        self.rank = rank
        self.max_models = max_models
        self.offload_host_bytes = offload_host_bytes
        self.offload_dir = Path(offload_dir or Path(rank.cfg.trainer.output_dir) / "offload")
        shutil.rmtree(self.offload_dir, ignore_errors=True)  # a previous server's spills: its models ended
        self._ids: dict[str, None] = {}  # every model held (read by HTTP threads while models move)
        self.resident: dict[str, int] = {}  # model id -> its slot
        self.parked: dict[str, ParkedSlot] = {}  # model id -> its state off the GPU
        self._used: dict[str, int] = {}  # model id -> when an operation last needed it (LRU)
        self._loads: dict[str, int] = {}  # model id -> how many saved states were loaded into it
        self.copies: dict[str, str] = {}  # sampling copy -> the tenant it counts toward (resident only)
        self._decoding: set[str] = set()  # models with rows in the running engine call: never moved
        self._clock = 0
        self.stats = {"parked": 0, "restored": 0, "spilled": 0, "copies_loaded": 0, "copies_evicted": 0}

    # ------------------------------------------------------------------ models
    @property
    def models(self) -> KeysView[str]:
        """Every model this backend holds, resident or parked."""
        return self._ids.keys()

    def model(self, model_id: str) -> OpenSlot:
        """The model's LoRA rank, seed and weight version (``name`` is the model id; ``slot`` is -1
        while it is parked). Reads only, safe beside the thread that moves models: a model being
        parked or restored is in ``parked`` until its slot holds it and in ``resident`` until its
        parked state is complete."""
        slot = self.resident.get(model_id)
        opened = self.rank.slots.get(slot) if slot is not None else None
        if opened is not None and opened.name == model_id:
            return opened
        parked = self.parked.get(model_id)
        if parked is None:
            raise TinkerError("model_id", f"unknown model {model_id!r} (never created, or unloaded)")
        m = parked.meta
        return OpenSlot(-1, m.name, m.rank, m.alpha, m.seed, m.version, parked.run, m.targets or ())

    def lora_targets(
        self, train_attn: bool, train_mlp: bool, train_unembed: bool, unembed_lora: str = "ignore"
    ) -> tuple[str, ...]:
        """The module families a client's ``lora_config`` trains. ``train_unembed`` where the model
        has no unembed LoRA (``output_layer`` not in ``lora.target_modules``): ``unembed_lora``
        ``ignore`` trains the rest, ``error`` refuses. Training nothing is refused."""
        available = self.rank.lora_families
        if train_unembed and UNEMBED not in available and unembed_lora == "error":
            raise TinkerError(
                "lora_config.train_unembed",
                "this server has no unembedding LoRA (lora.target_modules has no output_layer): pass "
                "train_unembed=False, or serve with tinker.unembed_lora=ignore",
            )
        asked = {ATTN: train_attn, MLP: train_mlp, UNEMBED: train_unembed}
        targets = tuple(f for f in available if asked[f])
        if not targets:
            raise TinkerError(
                "lora_config",
                f"trains nothing: this server's LoRA covers {' and '.join(available)} "
                f"(train_{', train_'.join(available)}); set at least one of them to True",
            )
        return targets

    def create_model(
        self, model_id: str, rank: int, seed: int = 0, targets: Sequence[str] | None = None
    ) -> OpenSlot:
        """Initialise a fresh LoRA of ``rank`` training ``targets`` (None: every family the model
        wraps) in a slot (parking the least recently used model when none is free)."""
        self.check_new_model(model_id, rank)
        slot = self._free_slot(keep=set())
        opened = self.rank.open_slot(
            slot, rank, LORA_ALPHA, seed, OptimizerSpec(clip_grad=0.0), model_id, targets=targets
        )
        self.resident[model_id] = opened.slot
        self._ids[model_id] = None
        self._touch(model_id)
        return opened

    def check_new_model(self, model_id: str, rank: int) -> None:
        """Raise :class:`TinkerError` when :meth:`create_model` would refuse this model: its id is
        taken, its rank is out of range, or the server holds ``max_models`` models already."""
        if model_id in self._ids:
            raise TinkerError("model_id", f"model {model_id!r} exists already")
        max_rank = self.rank.max_rank
        if not 1 <= rank <= max_rank:
            raise TinkerError("lora_config.rank", f"must be in 1..{max_rank} (lora.max_rank), got {rank}")
        if len(self._ids) >= self.max_models:
            raise TinkerError(
                "model", f"the server holds {self.max_models} models (tinker.max_models): unload one first"
            )

    def unload_model(self, model_id: str) -> None:
        """Forget the model: weights, grads and optimizer state are erased (resident or parked)."""
        self.model(model_id)
        if model_id in self.resident:
            self.rank.close_slot(self.resident.pop(model_id))
        else:
            self.parked.pop(model_id).discard()
        self._used.pop(model_id, None)
        self._ids.pop(model_id, None)
        self._loads.pop(model_id, None)

    def stamp(self, model_id: str) -> tuple[int, int]:
        """What names the weights a model holds now: its version and how many loads it had (a
        ``load_state`` with the optimizer may bring back a version number it had before)."""
        return self.model(model_id).version, self._loads.get(model_id, 0)

    def _touch(self, model_id: str) -> None:
        self._clock += 1
        self._used[model_id] = self._clock

    def _free_slot(self, keep: set[str]) -> int:
        """A free slot, parking the least recently used resident model not in ``keep`` if needed."""
        free = self.rank.free_slots()
        if free:
            return free[0]
        victims = sorted(
            (m for m in self.resident if m not in keep and m not in self._decoding),
            key=lambda m: self._used.get(m, 0),
        )
        if not victims:
            raise TinkerError(
                "model", f"one batch needs more than the {self.rank.num_slots} slots (lora.num_slots)"
            )
        victim = victims[0]
        slot = self.resident[victim]
        if victim in self.copies:  # a sampling copy: its weights are on disk, nothing to keep
            self.drop_copy(victim)
            return slot
        self.parked[victim] = park(self.rank, slot)
        del self.resident[victim]
        self.rank.close_slot(slot)
        self.stats["parked"] += 1
        self._spill_past_budget()
        return slot

    def _spill_past_budget(self) -> None:
        """Move the least recently used parked states to disk while host memory holds too much."""
        self.stats["spilled"] += spill_over_budget(
            self.parked, self.offload_host_bytes, self.offload_dir, self.rank.layout.tp_rank,
            lambda m: self._used.get(m, 0),
        )  # fmt: skip

    def _slot_of(self, model_id: str, keep: set[str] | None = None) -> int:
        """The slot of ``model_id`` for an operation, restoring it if it is parked (``keep``: the
        other models the same operation needs, never parked to make room)."""
        self.model(model_id)
        self._touch(model_id)
        slot = self.resident.get(model_id)
        if slot is not None:
            return slot
        slot = self._free_slot(keep={model_id, *(keep or ())})
        parked = self.parked[model_id]
        try:
            unpark(self.rank, parked, slot)
        except BaseException:  # the model stays parked, the slot free
            if slot in self.rank.slots:
                self.rank.close_slot(slot)
            raise
        self.resident[model_id] = slot
        del self.parked[model_id]
        parked.discard()
        self.stats["restored"] += 1
        return slot

    # ------------------------------------------------------------------ sampling copies
    def load_copy(self, key: str, directory: str | Path, owner: str, max_per_owner: int) -> None:
        """Make the sampling copy ``key`` resident: the saved weights in ``directory`` (written by
        :meth:`save_sampler_weights`) in a slot, with no optimizer state, counted toward ``owner``.
        Past ``max_per_owner`` resident copies of ``owner``, its least recently used one goes first;
        a slot is freed as for a model (the least recently used resident is evicted or parked)."""
        if key in self.resident:
            self._touch(key)
            return
        mine = sorted(
            (k for k, o in self.copies.items() if o == owner and k not in self._decoding),
            key=lambda k: self._used.get(k, 0),
        )
        for victim in mine[: max(len(mine) - max_per_owner + 1, 0)]:
            self.drop_copy(victim)
        saved = read_shard(directory, self.rank.layout.tp_rank)  # once; FileNotFoundError: deleted
        meta = shard_meta(saved)
        if meta is None:
            raise TinkerError("model_path", "not readable sampler weights: no meta")
        slot = self._free_slot(keep=set())
        self.rank.open_slot(
            slot, meta.rank, meta.alpha, meta.seed, OptimizerSpec(clip_grad=0.0), key, targets=meta.targets
        )
        try:
            self.rank.load_slot(slot, saved, optimizer=False)
        except BaseException:
            self.rank.close_slot(slot)
            raise
        self.resident[key] = slot
        self.copies[key] = owner
        self.stats["copies_loaded"] += 1
        self._touch(key)

    def drop_copy(self, key: str) -> None:
        """Evict the sampling copy ``key`` (nothing when it is not resident)."""
        if self.copies.pop(key, None) is None:
            return
        self.rank.close_slot(self.resident.pop(key))
        self._used.pop(key, None)
        self.stats["copies_evicted"] += 1

    def save_sampler_weights(self, model_id: str, path: str | Path) -> Path:
        """The model's LoRA weights and meta alone (no optimizer state), at its own rank, in the
        directory ``path``: what :meth:`load_copy` reads."""
        self.rank.save_slot(self._slot_of(model_id), path, optimizer=False)
        return Path(path)

    # ------------------------------------------------------------------ training
    def check(self, request: ForwardBackwardRequest) -> dict[str, float]:
        """Validate a request (model, loss, every datum's inputs) before it joins a batch: token
        ids whole and in the vocabulary, every loss input present, as long as the input and finite."""
        self.model(request.model_id)
        config = check_loss(request.loss_fn, request.loss_fn_config)
        if not request.data:
            raise TinkerError("data", "a forward/backward request needs at least one datum")
        limit, vocab = self.rank.max_seq_len, self.rank.vocab_size
        for i, d in enumerate(request.data):
            n = len(d.tokens)
            if not 1 <= n <= limit:
                raise TinkerError(f"data[{i}].model_input", f"needs 1..{limit} tokens, got {n}")
            _token_ids(d.tokens, f"data[{i}].model_input", vocab)
            topk = _topk_width(request.loss_fn, d, f"data[{i}].loss_fn_inputs")
            for key in LOSS_INPUTS[request.loss_fn]:
                where = f"data[{i}].loss_fn_inputs.{key}"
                values = d.inputs.get(key)
                if values is None:
                    raise TinkerError(f"data[{i}].loss_fn_inputs", f"{request.loss_fn} needs {key!r}")
                if len(values) != n:
                    raise TinkerError(where, f"has {len(values)} values for {n} input tokens")
                if topk:  # [N, K]: checked as its N * K values
                    values = np.asarray(values).reshape(-1)
                if key == "target_tokens":
                    _token_ids(values, where, vocab)
                else:
                    _finite(values, where)
                    check_input(request.loss_fn, key, values, where)
        return config

    def forward_backward(self, requests: Sequence[ForwardBackwardRequest]) -> list[ForwardBackwardOutput]:
        """Checked requests of any models as one mixed batch; gradients accumulate in each model's
        slot (``forward_only`` requests score without a backward)."""
        needed = list(dict.fromkeys(r.model_id for r in requests))
        width = self.rank.num_slots
        if len(needed) > width:  # more models than slots: in turns of at most num_slots models
            outputs: dict[int, ForwardBackwardOutput] = {}
            for start in range(0, len(needed), width):
                turn = set(needed[start : start + width])
                picked = [i for i, r in enumerate(requests) if r.model_id in turn]
                for i, out in zip(picked, self.forward_backward([requests[i] for i in picked]), strict=True):
                    outputs[i] = out
            return [outputs[i] for i in range(len(requests))]
        rows: list[ScoredRow] = []
        widths: list[int] = []  # K of each row's [N, K] targets (0: one target per position)
        losses: dict[int, tuple[str, dict[str, float]]] = {}
        for tag, request in enumerate(requests):
            losses[tag] = (request.loss_fn, check_loss(request.loss_fn, request.loss_fn_config))
            slot = self._slot_of(request.model_id, keep=set(needed))
            keys = [k for k in LOSS_INPUTS[request.loss_fn] if k != "target_tokens"]
            for d in request.data:
                targets = np.asarray(d.inputs["target_tokens"]).astype(np.int64)
                k = targets.shape[1] if targets.ndim == 2 else 0
                # [N, K] targets: position p scored K times, once per target (top-k distillation)
                positions = (
                    np.repeat(np.arange(len(d.tokens)), k).tolist() if k else list(range(len(d.tokens)))
                )
                values = {key: _floats(np.asarray(d.inputs[key]).reshape(-1)) for key in keys}
                rows.append(
                    ScoredRow(
                        slot, _ints(d.tokens), positions, _ints(targets.reshape(-1)), values=values, tag=tag
                    )
                )
                widths.append(k)
        loss = tinker_loss(losses)
        logprobs: list[list[float]] = [[] for _ in rows]
        metrics: dict[int, dict[str, float]] = {}
        for backward in (True, False):  # forward-only requests score without a graph
            picked = [i for i, r in enumerate(rows) if requests[r.tag].forward_only != backward]
            if not picked:
                continue
            result = self.rank.forward_backward([rows[i] for i in picked], loss, backward=backward)
            metrics.update(result.per_slot)
            for i, lp in zip(picked, result.logprobs, strict=True):
                k = widths[i]
                logprobs[i] = [lp[j : j + k] for j in range(0, len(lp), k)] if k else lp
        outputs = []
        for tag, _ in enumerate(requests):
            m = metrics.get(tag, {})
            outputs.append(
                ForwardBackwardOutput(
                    [lp for r, lp in zip(rows, logprobs, strict=True) if r.tag == tag],
                    {"loss:sum": m.get("loss", 0.0), "num_tokens:sum": m.get("num_tokens", 0.0)},
                )
            )
        return outputs

    def optim_step(self, model_id: str, lr: float, beta1: float = 0.9, beta2: float = 0.95,
                   eps: float = 1e-12, weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> dict[str, float]:  # fmt: skip
        """One AdamW step of this model's slot with the given parameters (decoupled weight decay); a
        step that moved the weights makes the slot's next version."""
        slot = self._slot_of(model_id)
        spec = OptimizerSpec(
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, clip_grad=grad_clip_norm
        )
        s = self.rank.optim_step([slot], {slot: spec})[slot]
        return {"grad_norm:mean": s.grad_norm, "skipped:sum": float(s.skipped)}

    # ------------------------------------------------------------------ sampling
    def sample(self, model_id: str | None, prompt: list[int], num_samples: int, sampling: SamplingSpec,
               seed: int = 0) -> list[GenerationResult]:  # fmt: skip
        """One request of :meth:`sample_many`: its samples, or its error raised."""
        (outcome,) = self.sample_many([SampleRequest(model_id, list(prompt), num_samples, sampling, seed)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def has_room(self) -> bool:
        """Whether one more model can get a slot during the running engine call: a slot is free, or
        a resident model without rows in it can be moved out."""
        return bool(self.rank.free_slots()) or any(m not in self._decoding for m in self.resident)

    def sample_many(
        self,
        requests: Sequence[SampleRequest],
        on_done: Callable[[int, SampleOutcome], None] | None = None,
        more: SampleJoiner | None = None,
    ) -> list[SampleOutcome]:
        """The requests of any models (and of the base model) as one engine call with mixed slots,
        in turns of at most ``lora.num_slots`` models. Each request keeps its own seeds, and a row's
        tokens do not depend on its batch (on a CPU its logprobs neither), so a request samples
        what it would alone. A request the backend refuses (an unknown model, a prompt the engine
        cannot serve) gets its error in its place and changes nothing; the others run. A request that
        fails the engine call anyway gets its error, and the call runs again without it
        (:meth:`~miles_multilora.trainer.rank.TrainerRank.sample`); a failure of every request
        (the engine itself) is raised.
        ``on_done(i, outcome)`` hears each request's outcome as soon as it is known: a refusal at
        once, samples when the request's last sample ends (the others may still decode).

        ``more`` (a streaming engine on one rank): requests that arrive while the last turn decodes
        join its batch at a host check, numbered on from the last, into free rows; a model with
        rows in flight is never parked or evicted to make room for them."""
        outcomes: list[SampleOutcome | None] = [None] * len(requests)

        def done(i: int, outcome: SampleOutcome) -> None:
            outcomes[i] = outcome
            if on_done is not None:
                on_done(i, outcome)

        models = list(dict.fromkeys(r.model_id for r in requests if r.model_id is not None))
        width = self.rank.num_slots
        turns = [models[start : start + width] for start in range(0, len(models), width)] or [[]]
        for k, turn in enumerate(turns):
            keep = set(turn)
            picked = [
                i for i, r in enumerate(requests) if r.model_id in keep or (r.model_id is None and k == 0)
            ]
            groups, where = [], []
            for i in picked:
                try:
                    groups.append(self._generation_requests(requests[i], keep))
                except Exception as exc:  # noqa: BLE001 - this request's own failure
                    done(i, exc)
                    continue
                where.append(i)
            joiner = _Joiner(self, more, outcomes, where, done) if more and k == len(turns) - 1 else None
            if groups:
                self._decoding = set(keep)
                try:
                    self.rank.sample(
                        groups,
                        on_group=lambda g, results, where=where: done(where[g], results),
                        joiner=joiner,
                    )
                finally:
                    self._decoding = set()
        return outcomes  # type: ignore[return-value] - every request has its outcome

    def _generation_requests(self, request: SampleRequest, keep: set[str]) -> list[GenerationRequest]:
        """The engine's requests of one sample request, its model in a slot (restored if parked,
        never parking a model of ``keep``), checked."""
        if request.num_samples < 1:
            raise TinkerError("num_samples", "must be >= 1")
        prompt, sampling, seed = request.prompt, request.sampling, request.seed
        if request.model_id is None:
            generation = [
                GenerationRequest.for_base(prompt, sampling, seed=seed + j)
                for j in range(request.num_samples)
            ]
        else:
            e = self.rank.slot(self._slot_of(request.model_id, keep))
            generation = [
                GenerationRequest(request.model_id, e.slot, e.version, list(prompt), sampling, seed=seed + j)
                for j in range(request.num_samples)
            ]
        self._check_generation(generation[0])
        return generation

    def check_scoring(self, prompt: list[int], scoring: PromptScoring) -> None:
        """Whether ``scoring`` fits this prompt and vocabulary (``last_n`` in 1..len - 1)."""
        vocab = self.rank.vocab_size
        if scoring.topk > vocab:
            raise TinkerError(
                "topk_prompt_logprobs", f"must be at most the vocabulary size {vocab}, got {scoring.topk}"
            )
        if scoring.last_n is not None and not 1 <= scoring.last_n <= len(prompt) - 1:
            raise TinkerError(
                "prompt_logprobs_last_n",
                f"must be in 1..{len(prompt) - 1} (the prompt's length - 1), got {scoring.last_n}",
            )

    def score_prompt(self, model_id: str | None, prompt: list[int], scoring: PromptScoring) -> PromptScores:
        """log p(prompt[i] | prompt[:i]) for each scored position (temperature 1, fp32 log-softmax)
        and the top-k tokens there, by the trainer's forward on the model's live slot (or on the base
        model: ``model_id`` None)."""
        self.check_scoring(prompt, scoring)
        n = len(prompt)
        first = 1 if scoring.last_n is None else n - scoring.last_n
        slot = -1 if model_id is None else self._slot_of(model_id)
        (score,) = self.rank.score(
            [ScoredRow(slot, list(prompt), list(range(first - 1, n - 1)))], scoring.topk
        )
        logprobs = score.logprobs if scoring.logprobs else None
        return PromptScores(first, n, logprobs, scoring.topk, score.topk_ids, score.topk_logprobs)

    def check_sample(self, prompt: list[int], sampling: SamplingSpec) -> None:
        """Whether the engine can serve this prompt and these parameters (prompt ids in the
        vocabulary, ``top_k`` and stop token ids within it, room in the context window and the KV
        cache, stop strings with a tokenizer)."""
        try:
            check_sampling_vocab(sampling, self.rank.vocab_size)
        except SpecError as exc:
            raise TinkerError(sampling_params_key(exc.key), exc.message) from exc
        self._check_generation(GenerationRequest.for_base(prompt, sampling, seed=0))

    def _check_generation(self, request: GenerationRequest) -> None:
        problem = unservable_sampling(request)  # a value past params.sampling: named as sent
        if problem is not None:
            raise TinkerError(sampling_params_key(problem[0]), problem[1])
        try:
            self.rank.check_request(request)
        except RolloutError as exc:
            message = str(exc).split(": ", 1)[-1]  # without the engine's "request 0 (<adapter>)" prefix
            raise TinkerError("prompt", message) from exc

    # ------------------------------------------------------------------ state
    def save_state(self, model_id: str, path: str | Path) -> Path:
        """The model's exact slot tensors, optimizer state and version, in the directory ``path``."""
        self.rank.save_slot(self._slot_of(model_id), path)
        return Path(path)

    def export_peft(self, model_id: str, path: str | Path) -> Path:
        """The model's LoRA as a PEFT adapter directory ``path`` (``adapter_model.safetensors`` and
        ``adapter_config.json``, HF module names)."""
        self.rank.export_peft(self._slot_of(model_id), path)
        return Path(path)

    def load_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> None:
        """Put a saved state into the model's slot: its optimizer state and version too, or (without
        ``optimizer``) the weights alone, as a new version, so no sampler of the old weights
        serves the new ones."""
        e = self.model(model_id)
        meta = read_state(path)
        if meta.rank != e.rank:
            raise TinkerError("path", f"the saved state has rank {meta.rank}, the model {e.rank}")
        if meta.targets is not None and meta.targets != e.targets:
            raise TinkerError(
                "path",
                f"the saved state trains {list(meta.targets)}, the model {list(e.targets)} "
                "(train_attn / train_mlp / train_unembed): load it into a model created like it, "
                "or with create_training_client_from_state",
            )
        self.rank.load_slot(self._slot_of(model_id), path, optimizer=optimizer)
        self._loads[model_id] = self._loads.get(model_id, 0) + 1


def read_state(path: str | Path) -> SlotMeta:
    """What a state written by :meth:`TinkerBackend.save_state` holds (checked to be readable:
    tensors only, ``weights_only``)."""
    try:
        saved = read_shard(path, 0)
        meta = shard_meta(saved)
        saved["slot"], saved["optimizer"]  # noqa: B018 - both must be there
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
        raise TinkerError("path", f"not a readable saved state: {type(exc).__name__}") from exc
    if meta is None:
        raise TinkerError("path", "not a readable saved state: no meta")
    return meta
