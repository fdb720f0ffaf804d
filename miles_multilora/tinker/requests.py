"""The Tinker protocol's requests as the backend takes them, and their checks.

The types a route builds from a request body (:mod:`~miles_multilora.tinker.params`,
:mod:`~miles_multilora.tinker.wire`) and :class:`~miles_multilora.tinker.backend.TinkerBackend`
runs: a forward/backward request of datums, a sample request and what it asks of its prompt, and
their answers. The checks here need only the model's sequence limit and vocabulary: every one
raises :class:`TinkerError` naming the field, so a bad request fails alone and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.errors import SpecError
from miles_multilora.lora.targets import ATTN, MLP, UNEMBED
from miles_multilora.rollout import GenerationRequest, GenerationResult
from miles_multilora.tinker.losses import LOSS_INPUTS, TOPK_LOSSES, check_input, check_loss, input_keys
from miles_multilora.trainer.shard import SlotMeta, read_shard, shard_meta

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


@dataclass(frozen=True, eq=False)
class TargetIds:
    """``target_prompt_logprobs``: token ids ``[len(prompt) - 1, K]``, row ``i`` scored at prompt
    position ``i + 1`` (-1: a cell that asks nothing); ``csr`` ``(crow, col)`` when the request was
    sparse CSR, whose layout its answer keeps."""

    ids: np.ndarray
    csr: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True, eq=False)
class PromptScoring:
    """What a sample request asks of its prompt: its logprobs (``logprobs``), the ``topk`` most
    likely tokens at each position (0: none), scored over the last ``last_n`` tokens (None: all);
    the logprobs of chosen ids (``targets``); and ``alt_k`` draws at each position after the first,
    at ``temperature``, seeded ``seed`` (``prompt_alt_tokens_k``; neither depends on ``last_n``)."""

    logprobs: bool = False
    topk: int = 0
    last_n: int | None = None
    targets: TargetIds | None = None
    alt_k: int = 0
    temperature: float = 1.0
    seed: int = 0

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own logprobs or top-k are asked for."""
        return self.logprobs or self.topk > 0


@dataclass
class PromptScores:
    """A prompt scored from position ``first`` on (positions before it, the first token at least,
    are not scored): ``logprobs[j]`` is log p(prompt[first + j] | prompt[:first + j]) (None when not
    asked for); ``topk_ids[j]`` / ``topk_logprobs[j]`` the most likely tokens there, highest first.
    ``target_logprobs``: float32 of the targets' shape (0.0 where a cell asks nothing);
    ``alt_ids`` / ``alt_logprobs``: ``[length - 1, k]`` draws and their logprobs."""

    first: int
    length: int
    logprobs: list[float] | None
    k: int = 0
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    targets: TargetIds | None = None
    target_logprobs: np.ndarray | None = None
    alt_ids: np.ndarray | None = None
    alt_logprobs: np.ndarray | None = None


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
        """The requests that join now (possibly none); other work that may run between decode
        steps runs first."""
        ...

    def ran_between(self) -> bool:
        """Whether the last :meth:`take` ran other work between decode steps."""
        ...


@dataclass
class SampleOutput:
    """A sample request's answer: its sequences, its prompt's scores when asked for, and the top-k
    ``(ids, logprobs)`` at each sampled token of each sequence (``topk_sample_logprobs``)."""

    sequences: list[GenerationResult]
    prompt: PromptScores | None = None
    sample_topk: list[tuple[list[list[int]], list[list[float]]]] | None = None


def check_forward_backward(
    request: ForwardBackwardRequest, max_seq_len: int, vocab_size: int
) -> dict[str, float]:
    """The request's loss config, checked with every datum's inputs: token ids whole and in the
    vocabulary, every loss input present, as long as the input and finite."""
    config = check_loss(request.loss_fn, request.loss_fn_config)
    if not request.data:
        raise TinkerError("data", "a forward/backward request needs at least one datum")
    limit, vocab = max_seq_len, vocab_size
    for i, d in enumerate(request.data):
        n = len(d.tokens)
        if not 1 <= n <= limit:
            raise TinkerError(f"data[{i}].model_input", f"needs 1..{limit} tokens, got {n}")
        _token_ids(d.tokens, f"data[{i}].model_input", vocab)
        topk = _topk_width(request.loss_fn, d, f"data[{i}].loss_fn_inputs")
        for key in input_keys(request.loss_fn, d.inputs):
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


def check_scoring(prompt: list[int], scoring: PromptScoring, vocab_size: int) -> None:
    """Whether ``scoring`` fits this prompt and vocabulary (``last_n`` in 1..len - 1; target ids
    in the vocabulary, one row per prompt position after the first)."""
    targets = scoring.targets
    if targets is not None:
        rows = targets.ids.shape[0]
        if rows != len(prompt) - 1:
            raise TinkerError(
                "target_prompt_logprobs",
                f"has {rows} rows for a prompt of {len(prompt)} tokens: send len(prompt) - 1 = "
                f"{len(prompt) - 1} rows (row i scores prompt position i + 1)",
            )
        if targets.ids.max() >= vocab_size:
            raise TinkerError("target_prompt_logprobs", f"token ids must be in 0..{vocab_size - 1} (or -1)")
    if scoring.alt_k and len(prompt) < 2:
        raise TinkerError(
            "prompt_alt_tokens_k", "needs a prompt of at least 2 tokens (none is drawn at position 0)"
        )
    if scoring.topk > vocab_size:
        raise TinkerError(
            "topk_prompt_logprobs", f"must be at most the vocabulary size {vocab_size}, got {scoring.topk}"
        )
    if scoring.last_n is not None and not 1 <= scoring.last_n <= len(prompt) - 1:
        raise TinkerError(
            "prompt_logprobs_last_n",
            f"must be in 1..{len(prompt) - 1} (the prompt's length - 1), got {scoring.last_n}",
        )


def lora_targets(
    available: Sequence[str], train_attn: bool, train_mlp: bool, train_unembed: bool, unembed_lora: str
) -> tuple[str, ...]:
    """The module families (of the rank's ``available`` ones) a client's ``lora_config`` trains.
    ``train_unembed`` where the model has no unembed LoRA (``output_layer`` not in
    ``lora.target_modules``): ``unembed_lora`` ``ignore`` trains the rest, ``error`` refuses.
    Training nothing is refused."""
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


def ints(values: Sequence[int] | np.ndarray) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


def floats(values: Values) -> list[float]:
    return (
        values.astype(np.float64).tolist() if isinstance(values, np.ndarray) else [float(v) for v in values]
    )


class SampleJoin:
    """The rank's :class:`~miles_multilora.trainer.stream_sampling.GroupJoiner` for a sample call of the
    backend: each joining request becomes its generation requests (``prepare``, which gives its
    model a slot, never moving a model in ``decoding``: those with rows in flight), and its group
    is numbered on after the call's others."""

    def __init__(
        self,
        more: SampleJoiner,
        prepare: Callable[[SampleRequest, set[str]], list[GenerationRequest]],
        decoding: set[str],
        outcomes: list[SampleOutcome | None],
        where: list[int],
        done: Callable[[int, SampleOutcome], None],
    ) -> None:
        self.more, self.prepare, self.decoding = more, prepare, decoding
        self.outcomes, self.where, self.done = outcomes, where, done

    def waiting(self) -> bool:
        return self.more.waiting()

    def ran_between(self) -> bool:
        return self.more.ran_between()

    def join(self) -> list[list[GenerationRequest]]:
        groups = []
        for request in self.more.take():
            i = len(self.outcomes)
            self.outcomes.append(None)
            try:
                groups.append(self.prepare(request, self.decoding))
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                self.done(i, exc)
                continue
            if request.model_id is not None:
                self.decoding.add(request.model_id)
            self.where.append(i)
        return groups


def read_state(path: str | Path) -> SlotMeta:
    """What a state written by :meth:`~miles_multilora.tinker.backend.TinkerBackend.save_state` holds (checked to be readable:
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
