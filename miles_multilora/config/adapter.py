"""The adapter spec: what a user submits for one LoRA adapter (YAML, JSON or a dict).

The same schema is used by one-shot runs (``adapters=[...]`` in the run config), by the
controller's register call and by the HTTP API. Parsing goes through OmegaConf structured
configs, so unknown keys and wrong types fail with the offending key named; the semantic checks
below (name pattern, ranges, exactly one stop condition) raise :class:`SpecError` likewise.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from miles_multilora.config import strict
from miles_multilora.config.lora_targets import check_targets
from miles_multilora.config.safe_yaml import load_yaml_no_aliases
from miles_multilora.config.template import parse_template
from miles_multilora.errors import SpecError

# A name is also a directory name: no dot or dash first (".", "..", "-x"), at least one letter or digit.
ADAPTER_NAME_PATTERN = re.compile(r"^(?=.*[A-Za-z0-9])[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")
MAX_SPEC_BYTES = 64 * 1024  # a whole spec, as JSON
MAX_KWARGS_BYTES = 16 * 1024  # reward.kwargs / dataset.task_params, as JSON
MAX_TEXT_CHARS = 16 * 1024  # prompt.template / prompt.system_prompt
MAX_REGEX_CHARS = 1024  # reward.format_regex
# Below this (and above 0 = greedy) logits / temperature overflow: every loss is NaN, no step applies.
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_INT64 = 2**63 - 1  # every integer of a spec fits a signed 64-bit tensor; seeds are in 0..MAX_INT64
# top_k and token ids where the model's vocabulary is not known (the engines hold them as int32);
# where it is known they must be within it (check_sampling_vocab)
MAX_TOKEN_ID = 2**31 - 1
# Upper bounds that keep one spec from asking for unbounded work or memory.
LIMITS = {
    "n_samples_per_prompt": 1024,
    "prompts_per_step": 4096,
    "samples_per_step": 65536,  # n_samples_per_prompt * prompts_per_step
    "sampling.max_new_tokens": 131072,
    "sampling.temperature": 100.0,
    "reward.timeout_s": 3600.0,
    "reward.max_consecutive_failures": 1000,
    "optimizer.lr": 1.0,
    "optimizer.eps": 1.0,
    "optimizer.clip_grad": 1e6,
    "optimizer.warmup_steps": 10_000_000,
    "optimizer.total_steps": 10_000_000,
    "rank": 65536,
    "save_interval": 10_000_000,
    "reward.format_weight": 1e3,
    "reward.overlong_buffer_len": 131072,
    "reward.overlong_penalty_factor": 1e3,
    "alpha": 1e6,
    "num_steps": 10_000_000,
    "num_epochs": 1_000_000,
    "dataset.size": 10_000_000,
    "eval.size": 4096,
    "eval.samples": 1024,
    "eval.every": 10_000_000,
}
# A reasoning-gym eval set is checked against every training question once per start: keep that cheap.
EVAL_MAX_TRAIN_ITEMS = 100_000
LR_SCHEDULES = ("constant", "cosine")
EXTRACTION_RULES = ("last_number", "hash", "boxed", "none")


@dataclass
class OptimizerSpec:
    """Per-adapter AdamW settings; each slot has its own step counter and schedule."""

    lr: float = 1e-4
    schedule: str = "constant"  # constant | cosine (linear warmup, then cosine to min_lr_ratio * lr)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: int | None = None  # cosine horizon; defaults to the adapter's num_steps
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # per-adapter grad-norm clip; 0 disables


@dataclass
class DatasetSpec:
    """Where prompts come from: an HF dataset (local file/dir or hub id) or a reasoning-gym task."""

    path: str | None = None  # .jsonl / .json / .parquet / .arrow file, a saved dataset dir, or a hub id
    split: str = "train"
    prompt_key: str = "question"
    answer_key: str = "answer"
    task: str | None = None  # reasoning-gym generator name, e.g. "basic_arithmetic"
    task_params: dict[str, Any] = field(default_factory=dict)
    size: int = 1000  # number of procedural examples (reasoning-gym)
    seed: int = 0  # dataset generation and per-epoch shuffle seed
    shuffle: bool = True


@dataclass
class PromptSpec:
    """How a dataset row becomes a prompt. ``template`` is formatted with the row's fields."""

    template: str = "{prompt}"  # plain {field} placeholders only (a dataset column; {prompt}: the question)
    use_chat_template: bool = True  # apply the tokenizer's chat template when it has one
    system_prompt: str | None = None


@dataclass
class RewardSpec:
    """The adapter's own reward function.

    ``type`` is a built-in name (``reasoning_gym``, ``math_verify``, ``exact_match``, ``format``)
    or a custom ``module:function``.
    """

    type: str = "exact_match"
    extract: str = "last_number"  # exact_match extraction rule: last_number | hash | boxed | none
    format_regex: str | None = None  # for type=format (or as an additive bonus when format_weight > 0)
    format_weight: float = 0.0
    overlong_buffer_len: int = 0  # DAPO overlong shaping; 0 disables
    overlong_penalty_factor: float = 1.0
    timeout_s: float = 10.0  # per reward call
    max_consecutive_failures: int = 3  # then the adapter is marked FAILED
    batched: bool = False  # custom function takes lists instead of one sample
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingSpec:
    temperature: float = 1.0  # 0 = greedy, else at least MIN_TEMPERATURE (0.01)
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # a sample ends with any of these (kept)


@dataclass
class EvalSpec:
    """Held-out evaluation, run at the end of a step on the new weights; it never trains.

    ``at_start``: also evaluate the adapter once before its first training step (its step-0 eval,
    on the fresh slot, i.e. the base model): that step of the run only evaluates it, and it trains
    from the next one. An adapter resumed from a checkpoint (step > 0) is not evaluated at start
    again; its step-0 eval is in the metrics of the run it continues.

    HF datasets: held-out rows from ``split`` of ``dataset.path`` or from another ``path`` (the
    first ``size`` rows; ``prompt_key`` / ``answer_key`` default to the dataset's). Reasoning-gym:
    the same task and params generated from seeds ``seed, seed + 1, ...`` (default
    ``dataset.seed + dataset.size``, past the training seeds). Either way an item whose question
    equals a training question is skipped, so eval items never repeat training items.
    """

    size: int = 32  # held-out items (fewer when an HF eval split has fewer rows)
    every: int = 5  # evaluate every N of the adapter's steps; 0 = only at the end (always at the end)
    at_start: bool = True  # also evaluate at step 0, before the first training step
    samples: int = 1  # k per item: 1 = greedy (temperature 0); k > 1 = the adapter's sampling, pass@k
    path: str | None = None  # HF: a held-out file/dir/hub id (default dataset.path)
    split: str | None = None  # HF: a held-out split (default dataset.split)
    prompt_key: str | None = None  # HF: default dataset.prompt_key
    answer_key: str | None = None  # HF: default dataset.answer_key
    seed: int | None = None  # reasoning-gym: first generator seed (default dataset.seed + dataset.size)


def eval_pool_size(size: int) -> int:
    """Reasoning-gym candidates scanned (seeds ``seed .. seed + pool - 1``) for ``size`` held-out items."""
    return max(4096, 16 * size)


def eval_seed(spec: AdapterSpec) -> int:
    """The first reasoning-gym seed of ``spec``'s eval items (just past the training seeds by default)."""
    assert spec.eval is not None
    ds = spec.dataset
    return ds.seed + ds.size if spec.eval.seed is None else spec.eval.seed


@dataclass
class AdapterSpec:
    """One LoRA adapter's experiment: model-side settings, data, reward, sampling and budget."""

    name: str = "???"
    rank: int = 8
    alpha: float = 16.0
    # module families it trains, of those lora.target_modules wraps: attn | mlp | unembed; None: all
    lora_targets: list[str] | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    prompt: PromptSpec = field(default_factory=PromptSpec)
    reward: RewardSpec = field(default_factory=RewardSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    n_samples_per_prompt: int = 4
    prompts_per_step: int = 4
    num_steps: int | None = None
    num_epochs: int | None = None
    save_interval: int = 10  # steps between checkpoints; 0 = only the final one
    seed: int = 0  # LoRA init and sampling seed
    eval: EvalSpec | None = None  # optional held-out evaluation (EvalSpec)
    # when adapters take turns in the slots (controller.max_running above lora.num_slots): a higher
    # priority gets a slot first; among equal priorities, trained tokens are shared in proportion to share.
    # At most the tenant's max_priority (controller.default_tenant_quota / tenant_quotas; default 0)
    priority: int = 0
    share: float = 1.0
    # whose quotas it counts against (controller.tenant_quotas, docs/service.md); None: its own name
    tenant: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = OmegaConf.to_container(OmegaConf.structured(self), resolve=True)
        assert isinstance(out, dict)
        for key in ("eval", "tenant", "lora_targets"):  # a spec without them serialises as before
            if out.get(key) is None:
                out.pop(key, None)
        return out


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise SpecError(key, message)


def _check_numbers(node: Any, prefix: str = "") -> None:
    """Every float of the spec (nested dataclasses included) is finite, every integer (in lists too)
    fits a signed 64-bit integer."""
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            _check_numbers(value, f"{key}.")
        elif isinstance(value, float):
            _check(math.isfinite(value), key, f"must be a finite number, got {value}")
        elif isinstance(value, int) and not isinstance(value, bool):
            _check(abs(value) <= MAX_INT64, key, f"{strict.shown(value)} does not fit a 64-bit integer")


def _check_max(key: str, value: float) -> None:
    limit = LIMITS[key]
    _check(value <= limit, key, f"{value} is above the limit of {limit}")


def _check_seed(key: str, value: int | None) -> None:
    if value is not None:
        _check(0 <= value <= MAX_INT64, key, f"must be in 0..{MAX_INT64} (2**63 - 1), got {value}")


def check_optimizer(opt: OptimizerSpec, prefix: str = "optimizer.", zero_lr: bool = False) -> None:
    """AdamW settings the optimizer can apply: finite, ``lr`` in (0, 1] (``zero_lr``: [0, 1]),
    betas in [0, 1), ``eps`` in (0, 1], ``lr * weight_decay <= 1`` (the decay factor
    ``1 - lr * weight_decay`` stays >= 0). Keys are ``prefix`` + the field name."""
    for f in fields(opt):
        value = getattr(opt, f.name)
        if isinstance(value, float):
            _check(math.isfinite(value), f"{prefix}{f.name}", f"must be a finite number, got {value}")
    top = LIMITS["optimizer.lr"]
    _check(
        (opt.lr >= 0 if zero_lr else opt.lr > 0) and opt.lr <= top,
        f"{prefix}lr",
        f"must be in {'[' if zero_lr else '('}0, {top:g}], got {opt.lr:g}",
    )
    _check(
        opt.schedule in LR_SCHEDULES,
        f"{prefix}schedule",
        f"must be one of {LR_SCHEDULES}, got {opt.schedule!r}",
    )
    _check(opt.warmup_steps >= 0, f"{prefix}warmup_steps", "must be >= 0")
    _check(0.0 <= opt.min_lr_ratio <= 1.0, f"{prefix}min_lr_ratio", "must be in [0, 1]")
    _check(0.0 <= opt.beta1 < 1.0, f"{prefix}beta1", f"must be in [0, 1), got {opt.beta1}")
    _check(0.0 <= opt.beta2 < 1.0, f"{prefix}beta2", f"must be in [0, 1), got {opt.beta2}")
    _check(
        0.0 < opt.eps <= LIMITS["optimizer.eps"],
        f"{prefix}eps",
        f"must be in (0, {LIMITS['optimizer.eps']:g}], got {opt.eps:g} (e.g. 1e-8; 0 divides by zero)",
    )
    _check(opt.weight_decay >= 0, f"{prefix}weight_decay", f"must be >= 0, got {opt.weight_decay}")
    _check(
        opt.lr * opt.weight_decay <= 1.0,
        f"{prefix}weight_decay",
        f"lr * weight_decay must be <= 1 (each step multiplies the weights by 1 - lr * weight_decay), "
        f"got {opt.lr:g} * {opt.weight_decay:g}",
    )
    _check(
        0 <= opt.clip_grad <= LIMITS["optimizer.clip_grad"],
        f"{prefix}clip_grad",
        f"must be in [0, {LIMITS['optimizer.clip_grad']:g}] (0 disables clipping), got {opt.clip_grad}",
    )
    _check(opt.total_steps is None or opt.total_steps >= 1, f"{prefix}total_steps", "must be >= 1")
    for key, value in (("warmup_steps", opt.warmup_steps), ("total_steps", opt.total_steps or 0)):
        limit = LIMITS[f"optimizer.{key}"]
        _check(value <= limit, f"{prefix}{key}", f"{value} is above the limit of {limit}")


def check_sampling_vocab(sp: SamplingSpec, vocab_size: int, prefix: str = "sampling.") -> None:
    """``top_k`` and ``stop_token_ids`` within the model's vocabulary of ``vocab_size`` tokens."""
    _check(
        sp.top_k <= vocab_size,
        f"{prefix}top_k",
        f"must be -1 (off) or 1..{vocab_size} (the model's vocabulary), got {strict.shown(sp.top_k)}",
    )
    for i, token in enumerate(sp.stop_token_ids):
        _check(
            0 <= token < vocab_size,
            f"{prefix}stop_token_ids[{i}]",
            f"{strict.shown(token)} is not a token id of the model: use 0..{vocab_size - 1}",
        )


def check_sampling(
    sp: SamplingSpec, prefix: str = "sampling.", min_temperature: float = MIN_TEMPERATURE
) -> None:
    """Sampling settings every engine can represent and that sample something: temperature 0
    (greedy) or in ``[min_temperature, 100]``, top_p in (0, 1], top_k -1 (off) or
    ``1..MAX_TOKEN_ID``, max_new_tokens in 1..131072, at most 16 stop strings and stop token ids."""
    for key in ("temperature", "top_p"):
        value = getattr(sp, key)
        _check(math.isfinite(value), f"{prefix}{key}", f"must be a finite number, got {value}")
    _check(
        sp.temperature == 0 or sp.temperature >= min_temperature,
        f"{prefix}temperature",
        f"must be 0 (greedy) or at least {min_temperature:g}, got {sp.temperature:g}: a smaller temperature "
        "overflows the policy's log-probabilities (NaN loss, no step is ever applied)",
    )
    top = LIMITS["sampling.temperature"]
    _check(sp.temperature <= top, f"{prefix}temperature", f"{sp.temperature:g} is above the limit of {top:g}")
    _check(0 < sp.top_p <= 1, f"{prefix}top_p", f"must be in (0, 1], got {sp.top_p}")
    _check(
        sp.top_k == -1 or 1 <= sp.top_k <= MAX_TOKEN_ID,
        f"{prefix}top_k",
        f"must be -1 (off) or 1..{MAX_TOKEN_ID} (and at most the model's vocabulary), got {strict.shown(sp.top_k)}",
    )
    limit = LIMITS["sampling.max_new_tokens"]
    _check(
        1 <= sp.max_new_tokens <= limit,
        f"{prefix}max_new_tokens",
        f"must be in 1..{limit}, got {strict.shown(sp.max_new_tokens)}",
    )
    _check(len(sp.stop) <= MAX_STOP_STRINGS, f"{prefix}stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, stop in enumerate(sp.stop):
        _check(
            isinstance(stop, str) and 0 < len(stop) <= MAX_STOP_CHARS,
            f"{prefix}stop[{i}]",
            f"must be a string of 1-{MAX_STOP_CHARS} characters",
        )
    _check(
        len(sp.stop_token_ids) <= MAX_STOP_STRINGS,
        f"{prefix}stop_token_ids",
        f"at most {MAX_STOP_STRINGS} stop token ids",
    )
    for i, token in enumerate(sp.stop_token_ids):
        _check(
            isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= MAX_TOKEN_ID,
            f"{prefix}stop_token_ids[{i}]",
            f"must be a token id (an integer in 0..{MAX_TOKEN_ID}, and below the model's vocabulary size), "
            f"got {strict.shown(token)}",
        )


def validate_adapter_spec(
    spec: AdapterSpec, max_rank: int | None = None, vocab_size: int | None = None
) -> AdapterSpec:
    """Semantic checks that the schema cannot express (``vocab_size``: the model's vocabulary, when
    known, bounds ``sampling.top_k`` and ``sampling.stop_token_ids``). Raises :class:`SpecError`."""
    _check(
        isinstance(spec.name, str) and bool(ADAPTER_NAME_PATTERN.match(spec.name)),
        "name",
        f"{spec.name!r} is not a valid adapter name: use 1-64 characters from A-Z a-z 0-9 . _ -, "
        "with at least one letter or digit, not starting with '.' or '-'",
    )
    _check(
        spec.tenant is None
        or (isinstance(spec.tenant, str) and bool(ADAPTER_NAME_PATTERN.match(spec.tenant))),
        "tenant",
        f"{spec.tenant!r} is not a valid tenant name: use 1-64 characters from A-Z a-z 0-9 . _ -, "
        "with at least one letter or digit, not starting with '.' or '-' (or leave it out: the adapter's name)",
    )
    check_sampling(spec.sampling)  # first: its errors name the ranges, also of a huge value
    if vocab_size is not None:
        check_sampling_vocab(spec.sampling, vocab_size)
    _check_numbers(spec)
    _check(spec.rank >= 1, "rank", f"must be >= 1, got {spec.rank}")
    if max_rank is not None:
        _check(spec.rank <= max_rank, "rank", f"{spec.rank} exceeds the model's max_rank {max_rank}")
    _check(spec.alpha > 0, "alpha", f"must be > 0, got {spec.alpha}")
    if spec.lora_targets is not None:  # which of them the model wraps: AdmissionRules.lora_families
        spec.lora_targets = list(check_targets(spec.lora_targets))
    opt = spec.optimizer
    check_optimizer(opt)
    ds = spec.dataset
    _check(
        (ds.path is None) != (ds.task is None),
        "dataset",
        "set exactly one of dataset.path (an HF dataset file/dir/hub id) or dataset.task (a reasoning-gym task)",
    )
    _check(ds.size >= 1, "dataset.size", "must be >= 1")
    _check_seed("dataset.seed", ds.seed)
    _check(
        ds.seed + ds.size <= MAX_INT64, "dataset.seed", f"dataset.seed + dataset.size must be <= {MAX_INT64}"
    )
    _check_seed("seed", spec.seed)
    rw = spec.reward
    _check(bool(rw.type), "reward.type", "must name a built-in reward or a module:function")
    _check(rw.extract in EXTRACTION_RULES, "reward.extract", f"must be one of {EXTRACTION_RULES}")
    _check(rw.timeout_s > 0, "reward.timeout_s", "must be > 0")
    _check(rw.max_consecutive_failures >= 1, "reward.max_consecutive_failures", "must be >= 1")
    _check(rw.overlong_buffer_len >= 0, "reward.overlong_buffer_len", "must be >= 0")
    _check(rw.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", "must be >= 0")
    _check(
        abs(rw.format_weight) <= LIMITS["reward.format_weight"],
        "reward.format_weight",
        f"must be in -{LIMITS['reward.format_weight']:g}..{LIMITS['reward.format_weight']:g}",
    )
    _check(spec.n_samples_per_prompt >= 1, "n_samples_per_prompt", "must be >= 1")
    _check(spec.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
    _check(
        (spec.num_steps is None) != (spec.num_epochs is None),
        "num_steps",
        "set exactly one stop condition: num_steps or num_epochs",
    )
    if spec.num_steps is not None:
        _check(spec.num_steps >= 1, "num_steps", "must be >= 1")
    if spec.num_epochs is not None:
        _check(spec.num_epochs >= 1, "num_epochs", "must be >= 1")
    _check(spec.save_interval >= 0, "save_interval", "must be >= 0")
    _check(-100 <= spec.priority <= 100, "priority", f"must be in -100..100, got {spec.priority}")
    _check(0.01 <= spec.share <= 100, "share", f"must be in 0.01..100, got {spec.share}")
    for key, text in (
        ("prompt.template", spec.prompt.template),
        ("prompt.system_prompt", spec.prompt.system_prompt),
    ):
        _check(len(text or "") <= MAX_TEXT_CHARS, key, f"longer than {MAX_TEXT_CHARS} characters")
    parse_template(spec.prompt.template)  # plain {field} placeholders only
    _check(
        len(rw.format_regex or "") <= MAX_REGEX_CHARS,
        "reward.format_regex",
        f"longer than {MAX_REGEX_CHARS} characters",
    )
    if spec.eval is not None:
        _validate_eval(spec)
    for key, value in (
        ("n_samples_per_prompt", spec.n_samples_per_prompt),
        ("prompts_per_step", spec.prompts_per_step),
        ("samples_per_step", spec.n_samples_per_prompt * spec.prompts_per_step),
        ("reward.timeout_s", rw.timeout_s),
        ("reward.max_consecutive_failures", rw.max_consecutive_failures),
        ("reward.overlong_buffer_len", rw.overlong_buffer_len),
        ("reward.overlong_penalty_factor", rw.overlong_penalty_factor),
        ("alpha", spec.alpha),
        ("rank", spec.rank),
        ("num_steps", spec.num_steps or 0),
        ("num_epochs", spec.num_epochs or 0),
        ("save_interval", spec.save_interval),
        ("dataset.size", ds.size),
    ):
        _check_max(key, value)
    return spec


def _validate_eval(spec: AdapterSpec) -> None:
    ev, ds = spec.eval, spec.dataset
    assert ev is not None
    _check(ev.size >= 1, "eval.size", f"must be >= 1, got {ev.size}")
    _check(ev.every >= 0, "eval.every", f"must be >= 0 (0: only at the end), got {ev.every}")
    _check(ev.samples >= 1, "eval.samples", f"must be >= 1, got {ev.samples}")
    for key, value in (("eval.size", ev.size), ("eval.samples", ev.samples), ("eval.every", ev.every)):
        _check_max(key, value)
    _check(
        ev.size * ev.samples <= LIMITS["samples_per_step"],
        "eval.samples",
        f"eval.size * eval.samples must be <= {LIMITS['samples_per_step']}",
    )
    if ds.task is not None:
        for key in ("path", "split", "prompt_key", "answer_key"):
            _check(
                getattr(ev, key) is None,
                f"eval.{key}",
                "is for HF datasets (dataset.path); a reasoning-gym eval draws new items (eval.seed)",
            )
        _check(
            ds.size <= EVAL_MAX_TRAIN_ITEMS,
            "eval",
            f"a reasoning-gym eval needs dataset.size <= {EVAL_MAX_TRAIN_ITEMS} (every training question "
            "is checked against the eval items)",
        )
        first, pool = eval_seed(spec), eval_pool_size(ev.size)
        _check_seed("eval.seed", ev.seed)
        _check(
            first + pool <= MAX_INT64, "eval.seed", f"eval seeds {first}..{first + pool - 1} pass {MAX_INT64}"
        )
        _check(
            first >= ds.seed + ds.size or first + pool <= ds.seed,
            "eval.seed",
            f"eval seeds {first}..{first + pool - 1} overlap the training seeds "
            f"{ds.seed}..{ds.seed + ds.size - 1}; leave eval.seed unset (default {ds.seed + ds.size}) "
            "or use one outside that range",
        )
        return
    _check(
        ev.seed is None, "eval.seed", "is for reasoning-gym datasets; an HF eval reads eval.split / eval.path"
    )
    _check(
        ev.path is not None or ev.split is not None,
        "eval.split",
        "name held-out data: eval.split (another split of dataset.path) or eval.path",
    )
    same = (ev.path or ds.path) == ds.path and (ev.split or ds.split) == ds.split
    _check(
        not same,
        "eval.path" if ev.path is not None else "eval.split",
        "names the training data itself; held-out data must be another split or file",
    )


def _load_source(source: AdapterSpec | dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(source, AdapterSpec):
        return source.to_dict()
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml", ".json"))
    ):
        path = Path(source)
        if not path.is_file():
            raise SpecError(str(path), "adapter spec file not found")
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError(str(path), f"larger than {MAX_SPEC_BYTES} bytes; an adapter spec is small")
        source = path.read_text()
    if isinstance(source, str):
        if len(source) > MAX_SPEC_BYTES:
            raise SpecError("<spec>", f"larger than {MAX_SPEC_BYTES} bytes; an adapter spec is small")
        try:
            source = json.loads(source) if source.lstrip().startswith("{") else load_yaml_no_aliases(source)
        except (yaml.YAMLError, json.JSONDecodeError, RecursionError) as exc:
            raise SpecError("<spec>", f"not valid YAML/JSON: {str(exc)[:300]}") from exc
    if not isinstance(source, dict):
        raise SpecError("<spec>", f"an adapter spec must be a mapping, got {type(source).__name__}")
    check_spec_size(source)
    return source


def _json_size(value: Any, key: str) -> int:
    try:
        return len(json.dumps(value, default=str))
    except (RecursionError, ValueError) as exc:
        raise SpecError(
            key, f"cannot be serialised as JSON ({type(exc).__name__}): nested too deeply?"
        ) from exc


def check_spec_size(data: dict[str, Any]) -> None:
    """Refuse an oversized spec before any schema work (which is slow on huge values)."""
    if _json_size(data, "<spec>") > MAX_SPEC_BYTES:
        raise SpecError("<spec>", f"larger than {MAX_SPEC_BYTES} bytes as JSON; an adapter spec is small")
    for section, key in (("reward", "kwargs"), ("dataset", "task_params")):
        part = data.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if value is not None and _json_size(value, f"{section}.{key}") > MAX_KWARGS_BYTES:
            raise SpecError(
                f"{section}.{key}",
                f"larger than {MAX_KWARGS_BYTES} bytes as JSON; put large data in a file the function reads",
            )


def parse_adapter_spec(
    source: AdapterSpec | dict[str, Any] | str | Path,
    max_rank: int | None = None,
    vocab_size: int | None = None,
) -> AdapterSpec:
    """Build a validated :class:`AdapterSpec` from a dict, a YAML/JSON string or a file path, every
    value taken as written (:mod:`~miles_multilora.config.strict`: no type coercion, no
    interpolation).

    Raises :class:`SpecError` naming the key to change; nothing is modified on error.
    """
    spec = strict.build(AdapterSpec, _load_source(source))
    return validate_adapter_spec(spec, max_rank=max_rank, vocab_size=vocab_size)
