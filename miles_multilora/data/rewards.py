"""Per-adapter reward functions, built from the adapter's :class:`RewardSpec`.

Built-ins (``reward.type``): ``reasoning_gym`` (the task's own ``score_answer``), ``math_verify``
(math answer equivalence), ``exact_match`` (answer extracted per ``reward.extract``) and
``format`` (1 when ``reward.format_regex`` matches). Anything else is ``module:function``:

- per sample: ``fn(prompt, completion, answer, metadata, **reward.kwargs) -> float``
- batched (``reward.batched``): ``fn(prompts, completions, answers, metadatas, **kwargs) -> list[float]``

Either may be ``async def``. A result may also be a mapping ``{"reward": float, "correct": bool}``.
On top of the base score: ``format_weight * (format_regex matches)`` and the DAPO overlong penalty.

A spec's ``format_regex`` is matched with the ``regex`` package, whose matcher stops itself after
``reward.timeout_s`` of CPU time (stdlib ``re`` cannot be stopped and holds the GIL throughout).
Only :func:`runs_in_process` rewards run in the trainer's process; every other reward runs in its
adapter's reward process (:mod:`miles_multilora.data.reward_process`), killed when a call overruns.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from miles_multilora.algo.overlong import overlong_penalty
from miles_multilora.config.adapter import AdapterSpec, RewardSpec
from miles_multilora.data.datasets import ReasoningGymDataset, create_reasoning_gym_dataset
from miles_multilora.data.extraction import (
    extract_answer,
    extract_tagged,
    normalize_answer,
    reference_answer,
)
from miles_multilora.data.records import RewardSample
from miles_multilora.data.reward_registry import BUILTIN_REWARDS
from miles_multilora.errors import SpecError

MAX_ABS_REWARD = 1e9  # larger values are treated as a failing reward (they overflow the statistics)
CUSTOM_REWARD_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass
class RewardOutput:
    """A sample's reward and, where the reward knows it, whether the answer was correct."""

    reward: float
    correct: bool | None = None


def _as_output(value: Any) -> RewardOutput:
    """Coerce a reward function's return value; raises ``TypeError``/``ValueError`` when unusable."""
    correct = None
    if isinstance(value, RewardOutput):
        value, correct = value.reward, value.correct
    elif isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"reward mapping lacks the 'reward' key: {sorted(value)}")
        correct = None if value.get("correct") is None else bool(value["correct"])
        value = value["reward"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        raise TypeError(f"reward must be a number, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ValueError(f"reward is not finite: {value}")
    if abs(float(value)) > MAX_ABS_REWARD:
        raise ValueError(f"reward {float(value):g} is out of range: |reward| must be <= {MAX_ABS_REWARD:g}")
    return RewardOutput(float(value), correct)


def resolve_custom_reward(target: str, key: str = "reward.type") -> Callable[..., Any]:
    """Import ``module:function``; :class:`SpecError` on ``key`` when it cannot be resolved."""
    if not CUSTOM_REWARD_PATTERN.match(target):
        raise SpecError(
            key, f"{target!r} is neither a built-in reward {BUILTIN_REWARDS} nor a 'module:function'"
        )
    module_name, func_name = target.split(":")
    if module_name in ("__main__", "__mp_main__"):
        raise SpecError(
            key,
            f"{target!r}: reward processes do not run the driver script ('__main__'); put {func_name!r} "
            f"in a module on sys.path and name it 'module:{func_name}'",
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise SpecError(key, f"cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise SpecError(key, f"module {module_name!r} has no callable {func_name!r}")
    return fn


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; run it to completion in a fresh event loop when it is a coroutine function."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


class UserPattern:
    """A spec's regular expression, compiled on first use and searched with a time limit.

    ``search`` raises ``TimeoutError`` after ``timeout_s`` seconds of CPU time (the ``regex``
    package's own limit; it releases the GIL while it matches). Compiling is lazy so that a pattern
    whose compilation explodes costs the first call's time, inside the reward process that a
    timeout kills, never the trainer's start-up.
    """

    def __init__(self, source: str, timeout_s: float) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self._compiled: Any = None

    def search(self, text: str) -> bool:
        if self._compiled is None:
            self._compiled = regex.compile(self.source)
        return self._compiled.search(text, timeout=self.timeout_s, concurrent=True) is not None


def compile_user_pattern(source: str) -> None:
    """Compile ``source`` with the engine rewards use (registration runs this in a bounded child)."""
    try:
        regex.compile(source)
    except regex.error as exc:
        raise SpecError("reward.format_regex", f"not a valid regular expression: {exc}") from exc


def runs_in_process(spec: AdapterSpec) -> bool:
    """True when ``spec``'s reward may run in the trainer's own process: only ``exact_match``
    without a ``format_regex`` (fixed, linear-time extraction patterns over a completion of at most
    ``sampling.max_new_tokens`` tokens: it cannot hang). Everything else runs spec code, a user
    regex, sympy (``math_verify``) or a task's scorer (``reasoning_gym``) in a reward process."""
    return spec.reward.type == "exact_match" and not spec.reward.format_regex


class RewardFunction:
    """An adapter's reward: a base score plus format bonus and overlong shaping.

    ``batched`` functions score a whole list in one call (:meth:`score_batch`); others one sample
    at a time (:meth:`score`). Thread-safe; timeouts and failure counting live in the manager.
    """

    def __init__(
        self, spec: RewardSpec, max_new_tokens: int, base: Callable[..., Any], batched: bool
    ) -> None:
        self.spec = spec
        self.max_new_tokens = max_new_tokens
        self.batched = batched
        self._base = base
        self._format = UserPattern(spec.format_regex, spec.timeout_s) if spec.format_regex else None

    def _shape(self, sample: RewardSample, out: RewardOutput) -> RewardOutput:
        reward = out.reward
        if self._format is not None and self.spec.format_weight > 0 and self.spec.type != "format":
            reward += self.spec.format_weight * float(bool(self._format.search(sample.completion)))
        if self.spec.overlong_buffer_len > 0 and sample.response_length is not None:
            limit = sample.max_new_tokens or self.max_new_tokens
            reward += overlong_penalty(
                sample.response_length,
                limit,
                self.spec.overlong_buffer_len,
                self.spec.overlong_penalty_factor,
            )
        return RewardOutput(reward, out.correct)

    def score(self, sample: RewardSample) -> RewardOutput:
        """Reward of one sample (per-sample functions)."""
        raw = self._base(sample)
        if isinstance(raw, list | tuple):  # a batched function declared as per-sample
            raise TypeError(
                f"reward {self.spec.type!r} returned a {type(raw).__name__}, not one number: if it scores "
                "a batch, fn(prompts, completions, answers, metadatas, **kwargs) -> list[float], set "
                "reward.batched: true in the adapter spec"
            )
        return self._shape(sample, _as_output(raw))

    def score_batch(self, samples: Sequence[RewardSample]) -> list[RewardOutput]:
        """Rewards of many samples in one call (batched functions)."""
        raw = self._base(list(samples))
        if not isinstance(raw, list | tuple) or len(raw) != len(samples):
            got = len(raw) if isinstance(raw, list | tuple) else type(raw).__name__
            raise ValueError(f"batched reward returned {got} values for {len(samples)} samples")
        return [self._shape(s, _as_output(v)) for s, v in zip(samples, raw, strict=True)]


def _reasoning_gym_base(spec: AdapterSpec, dataset: Any) -> Callable[[RewardSample], RewardOutput]:
    if spec.dataset.task is None:
        raise SpecError("reward.type", "'reasoning_gym' needs a reasoning-gym dataset (set dataset.task)")
    if isinstance(dataset, ReasoningGymDataset):
        generator = dataset.generator
    else:
        ds = spec.dataset
        generator = create_reasoning_gym_dataset(ds.task, dict(ds.task_params or {}), 1, ds.seed)
    tag = str(spec.reward.kwargs.get("answer_tag", "answer"))
    rule = spec.reward.extract

    def score(sample: RewardSample) -> RewardOutput:
        entry = sample.metadata.get("entry") or {"answer": sample.answer, "metadata": {}}
        answer = extract_tagged(sample.completion, tag)
        if answer is None:
            answer = extract_answer(sample.completion, rule)
        value = float(generator.score_answer(answer, entry))
        return RewardOutput(value, value >= 1.0)

    return score


def _exact_match_base(spec: AdapterSpec) -> Callable[[RewardSample], RewardOutput]:
    rule = spec.reward.extract

    def score(sample: RewardSample) -> RewardOutput:
        if sample.answer is None:
            raise ValueError("exact_match needs a reference answer (dataset.answer_key)")
        predicted = normalize_answer(extract_answer(sample.completion, rule))
        ok = predicted is not None and predicted == normalize_answer(reference_answer(sample.answer))
        return RewardOutput(float(ok), ok)

    return score


def _math_verify_base(spec: AdapterSpec) -> Callable[[RewardSample], RewardOutput]:
    from math_verify import parse, verify

    def score(sample: RewardSample) -> RewardOutput:
        if sample.answer is None:
            raise ValueError("math_verify needs a reference answer (dataset.answer_key)")
        gold_text = reference_answer(sample.answer)
        # signal-based timeouts are off: they only work in the main thread; the manager bounds the call
        gold = parse(f"${gold_text}$", parsing_timeout=None)
        if not gold:
            gold = parse(gold_text, parsing_timeout=None)
        pred = parse(sample.completion, parsing_timeout=None)
        ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
        return RewardOutput(float(ok), ok)

    return score


def _format_base(spec: AdapterSpec) -> Callable[[RewardSample], RewardOutput]:
    pattern = UserPattern(spec.reward.format_regex or "", spec.reward.timeout_s)

    def score(sample: RewardSample) -> RewardOutput:
        return RewardOutput(float(pattern.search(sample.completion)), None)

    return score


def _custom_base(spec: AdapterSpec) -> tuple[Callable[..., Any], bool]:
    fn = resolve_custom_reward(spec.reward.type)
    kwargs = dict(spec.reward.kwargs or {})
    if spec.reward.batched:

        def score_batch(samples: list[RewardSample]) -> Any:
            return _call(
                fn,
                [s.prompt for s in samples],
                [s.completion for s in samples],
                [s.answer for s in samples],
                [s.metadata for s in samples],
                **kwargs,
            )

        return score_batch, True

    def score(sample: RewardSample) -> Any:
        return _call(fn, sample.prompt, sample.completion, sample.answer, sample.metadata, **kwargs)

    return score, False


def check_reward_spec(spec: AdapterSpec) -> None:
    """Cheap checks of ``spec.reward`` (no dataset needed). Raises :class:`SpecError` naming the key."""
    rw = spec.reward
    if rw.format_regex is not None:
        try:  # syntax only: stdlib re compiles in linear time (regex's compile is bounded at registration)
            re.compile(rw.format_regex)
        except re.error as exc:
            raise SpecError("reward.format_regex", f"not a valid regular expression: {exc}") from exc
    if rw.type == "format" and not rw.format_regex:
        raise SpecError("reward.format_regex", "reward.type 'format' needs a format_regex")
    if rw.type == "reasoning_gym" and spec.dataset.task is None:
        raise SpecError("reward.type", "'reasoning_gym' needs a reasoning-gym dataset (set dataset.task)")
    if rw.overlong_buffer_len > spec.sampling.max_new_tokens:
        raise SpecError(
            "reward.overlong_buffer_len",
            f"{rw.overlong_buffer_len} exceeds sampling.max_new_tokens {spec.sampling.max_new_tokens}",
        )
    if rw.batched and rw.type in BUILTIN_REWARDS:
        raise SpecError(
            "reward.batched", f"only custom module:function rewards can be batched, not {rw.type!r}"
        )
    if rw.type not in BUILTIN_REWARDS:
        resolve_custom_reward(rw.type)


def build_reward(spec: AdapterSpec, dataset: Any | None = None) -> RewardFunction:
    """The reward function of adapter ``spec``. ``dataset`` (its loaded :class:`AdapterDataset`)
    lets a ``reasoning_gym`` reward reuse the task generator instead of building one."""
    check_reward_spec(spec)
    rw = spec.reward
    batched = False
    if rw.type == "reasoning_gym":
        base: Callable[..., Any] = _reasoning_gym_base(spec, dataset)
    elif rw.type == "exact_match":
        base = _exact_match_base(spec)
    elif rw.type == "math_verify":
        base = _math_verify_base(spec)
    elif rw.type == "format":
        base = _format_base(spec)
    else:
        base, batched = _custom_base(spec)
    return RewardFunction(rw, spec.sampling.max_new_tokens, base, batched)
