"""The run config (hydra tree under ``configs/``): its sections composed, validated at start.

``load_run_config(config_name, overrides)`` composes the hydra tree with ``key=value``
overrides, merges it into the structured :class:`RunConfig` (unknown keys and wrong types fail
with the key named) and runs the semantic checks: each section's own ``validate()``
(:mod:`miles_multilora.config.sections`), then what crosses sections. Adapters are listed as spec
file paths or inline mappings and parsed with :func:`parse_adapter_spec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from miles_multilora.algo.config import AlgoConfig
from miles_multilora.config.adapter import AdapterSpec, parse_adapter_spec
from miles_multilora.config.sections.checks import check
from miles_multilora.config.sections.controller import ControllerConfig
from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.config.sections.lora import LoRAConfig
from miles_multilora.config.sections.model import ModelConfig
from miles_multilora.config.sections.rollout import RolloutConfig
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.config.sections.trainer import TrainerConfig
from miles_multilora.errors import ConfigError, SpecError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    tinker: TinkerConfig = field(default_factory=TinkerConfig)
    adapters: list[Any] = field(default_factory=list)  # spec file paths or inline spec mappings


def _resolve_world(m: ModelConfig, t: TrainerConfig) -> None:
    """Fill in whichever of ``model.dp`` and ``trainer.world_size`` is unset (world = dp * tp * pp).
    With both unset, ``model.dp`` is the fewest replicas whose ranks hold ``model.ep`` expert-parallel
    groups (1 without expert parallelism; ``model.ep=4`` alone: 4)."""
    model_parallel = m.tp * m.pp
    if t.world_size is None:
        m.dp = m.dp or m.ep // math.gcd(m.ep, m.tp)
        t.world_size = m.dp * model_parallel
        _check_expert_parallel(m)
        return
    check(
        t.world_size % model_parallel == 0,
        "trainer.world_size",
        f"{t.world_size} ranks do not split into groups of model.tp * model.pp = {model_parallel}; use a "
        f"multiple of {model_parallel} (data parallelism: world_size = model.dp * tp * pp)",
    )
    if m.dp is None:
        m.dp = t.world_size // model_parallel
    check(
        t.world_size == m.dp * model_parallel,
        "trainer.world_size",
        f"must equal model.dp * model.tp * model.pp = {m.dp} * {m.tp} * {m.pp} = {m.dp * model_parallel} "
        "(or leave one of trainer.world_size and model.dp unset)",
    )
    _check_expert_parallel(m)


def _check_expert_parallel(m: ModelConfig) -> None:
    """Megatron-core's rule: the world splits into groups of ``ep * pp`` ranks (expert tensor
    parallelism 1), i.e. ``model.ep`` divides ``model.dp * model.tp``."""
    check(
        (m.dp * m.tp) % m.ep == 0,
        "model.ep",
        f"must divide model.dp * model.tp = {m.dp} * {m.tp} = {m.dp * m.tp} (the expert-parallel ranks are "
        f"taken from the data- and tensor-parallel ones); got model.ep={m.ep}: lower model.ep or raise model.dp",
    )


def validate_run_config(cfg: RunConfig) -> RunConfig:
    """Each section checks itself, then what crosses sections; raises :class:`ConfigError` naming the key."""
    for section in (cfg.model, cfg.lora, cfg.rollout, cfg.trainer, cfg.tinker, cfg.controller, cfg.logging):
        section.validate()
    _resolve_world(cfg.model, cfg.trainer)
    cfg.algo.validate()
    return cfg


def parse_adapters(cfg: RunConfig, base_dir: Path | None = None) -> list[AdapterSpec]:
    """Parse ``cfg.adapters`` (paths relative to ``base_dir`` or the cwd, or mappings) into specs."""
    specs: list[AdapterSpec] = []
    for i, item in enumerate(cfg.adapters):
        source: Any = item
        if isinstance(item, str):
            path = Path(item).expanduser()
            if not path.is_absolute() and base_dir is not None and not path.exists():
                path = base_dir / path
            source = path
        elif isinstance(item, DictConfig):
            source = OmegaConf.to_container(item, resolve=True)
        try:
            spec = parse_adapter_spec(source, max_rank=cfg.lora.max_rank)
        except SpecError as exc:
            raise ConfigError(f"adapters[{i}].{exc.key}", exc.message) from exc
        if any(s.name == spec.name for s in specs):
            raise ConfigError(f"adapters[{i}].name", f"duplicate adapter name {spec.name!r}")
        specs.append(spec)
    return specs


def load_run_config(
    config_name: str = "train", overrides: list[str] | None = None, config_dir: Path | None = None
) -> RunConfig:
    """Compose ``configs/<config_name>.yaml`` with hydra overrides; validate into a :class:`RunConfig`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    config_dir = config_dir or CONFIG_DIR
    if not (config_dir / f"{config_name}.yaml").is_file():
        raise ConfigError("config", f"no config named {config_name!r} in {config_dir}")
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)  # every schema key is overridable
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            composed = compose(config_name=config_name, overrides=list(overrides or []))
    except HydraException as exc:
        detail = " ".join(
            line.strip() for line in str(exc).splitlines() if line.strip() and "full_key" not in line
        )
        if exc.__cause__ is not None:
            detail = f"{detail} ({str(exc.__cause__).splitlines()[0]})".strip()
        raise ConfigError("override", detail or type(exc).__name__) from exc
    finally:
        GlobalHydra.instance().clear()
    return config_from_container(composed)


def config_from_container(data: Any) -> RunConfig:
    """Validate a mapping (or DictConfig) into a :class:`RunConfig`, naming the key of any error."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(getattr(exc, "full_key", None) or "config"), str(exc).splitlines()[0]) from exc
    assert isinstance(cfg, RunConfig)
    return validate_run_config(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
