"""Dataclass schemas for every config this package reads (hydra/OmegaConf structured configs)."""

from miles_multilora.config.adapter import (
    AdapterSpec,
    DatasetSpec,
    OptimizerSpec,
    PromptSpec,
    RewardSpec,
    SamplingSpec,
    parse_adapter_spec,
)

__all__ = [
    "AdapterSpec",
    "DatasetSpec",
    "OptimizerSpec",
    "PromptSpec",
    "RewardSpec",
    "SamplingSpec",
    "parse_adapter_spec",
]
