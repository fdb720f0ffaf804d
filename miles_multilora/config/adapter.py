"""The adapter spec: what a user submits for one LoRA adapter (YAML, JSON or a dict).

The same schema is used by one-shot runs (``adapters=[...]`` in the run config), by the
controller's register call and by the HTTP API. Parsing goes through OmegaConf structured
configs, so unknown keys and wrong types fail with the offending key named; the semantic checks
below (name pattern, ranges, exactly one stop condition) raise :class:`SpecError` likewise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from miles_multilora.errors import SpecError

ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
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

    template: str = "{prompt}"
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
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)


@dataclass
class AdapterSpec:
    """One LoRA adapter's experiment: model-side settings, data, reward, sampling and budget."""

    name: str = "???"
    rank: int = 8
    alpha: float = 16.0
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

    def to_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(self), resolve=True)  # type: ignore[return-value]


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise SpecError(key, message)


def validate_adapter_spec(spec: AdapterSpec, max_rank: int | None = None) -> AdapterSpec:
    """Semantic checks that the schema cannot express. Raises :class:`SpecError`."""
    _check(
        isinstance(spec.name, str) and bool(ADAPTER_NAME_PATTERN.match(spec.name)),
        "name",
        f"{spec.name!r} is not a valid adapter name: use 1-64 characters from A-Z a-z 0-9 . _ -",
    )
    _check(spec.rank >= 1, "rank", f"must be >= 1, got {spec.rank}")
    if max_rank is not None:
        _check(spec.rank <= max_rank, "rank", f"{spec.rank} exceeds the model's max_rank {max_rank}")
    _check(spec.alpha > 0, "alpha", f"must be > 0, got {spec.alpha}")
    opt = spec.optimizer
    _check(opt.lr > 0, "optimizer.lr", f"must be > 0, got {opt.lr}")
    _check(
        opt.schedule in LR_SCHEDULES,
        "optimizer.schedule",
        f"must be one of {LR_SCHEDULES}, got {opt.schedule!r}",
    )
    _check(opt.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
    _check(0.0 <= opt.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", "must be in [0, 1]")
    _check(0.0 <= opt.beta1 < 1.0, "optimizer.beta1", "must be in [0, 1)")
    _check(0.0 <= opt.beta2 < 1.0, "optimizer.beta2", "must be in [0, 1)")
    _check(opt.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    _check(opt.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0 (0 disables clipping)")
    ds = spec.dataset
    _check(
        (ds.path is None) != (ds.task is None),
        "dataset",
        "set exactly one of dataset.path (an HF dataset file/dir/hub id) or dataset.task (a reasoning-gym task)",
    )
    _check(ds.size >= 1, "dataset.size", "must be >= 1")
    rw = spec.reward
    _check(bool(rw.type), "reward.type", "must name a built-in reward or a module:function")
    _check(rw.extract in EXTRACTION_RULES, "reward.extract", f"must be one of {EXTRACTION_RULES}")
    _check(rw.timeout_s > 0, "reward.timeout_s", "must be > 0")
    _check(rw.max_consecutive_failures >= 1, "reward.max_consecutive_failures", "must be >= 1")
    _check(rw.overlong_buffer_len >= 0, "reward.overlong_buffer_len", "must be >= 0")
    sp = spec.sampling
    _check(sp.temperature >= 0, "sampling.temperature", "must be >= 0 (0 = greedy)")
    _check(0 < sp.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
    _check(sp.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")
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
    return spec


def _load_source(source: AdapterSpec | dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(source, AdapterSpec):
        return source.to_dict()
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml", ".json"))
    ):
        path = Path(source)
        if not path.is_file():
            raise SpecError(str(path), "adapter spec file not found")
        source = path.read_text()
    if isinstance(source, str):
        try:
            data = json.loads(source) if source.lstrip().startswith("{") else yaml.safe_load(source)
        except (yaml.YAMLError, json.JSONDecodeError) as exc:
            raise SpecError("<spec>", f"not valid YAML/JSON: {exc}") from exc
        source = data
    if not isinstance(source, dict):
        raise SpecError("<spec>", f"an adapter spec must be a mapping, got {type(source).__name__}")
    return (
        OmegaConf.to_container(OmegaConf.create(source), resolve=True)
        if not isinstance(source, dict)
        else source
    )


def parse_adapter_spec(
    source: AdapterSpec | dict[str, Any] | str | Path, max_rank: int | None = None
) -> AdapterSpec:
    """Build a validated :class:`AdapterSpec` from a dict, a YAML/JSON string or a file path.

    Raises :class:`SpecError` naming the key to change; nothing is modified on error.
    """
    data = _load_source(source)
    schema = OmegaConf.structured(AdapterSpec)
    try:
        merged = OmegaConf.merge(schema, data)
        spec = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "<spec>"
        msg = str(exc).splitlines()[0]
        raise SpecError(str(key), msg) from exc
    assert isinstance(spec, AdapterSpec)
    return validate_adapter_spec(spec, max_rank=max_rank)
