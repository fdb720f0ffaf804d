"""RL algorithms: GRPO/DAPO advantages, dynamic sampling, per-adapter policy loss and KL."""

from miles_multilora.algo.advantages import group_advantages, grpo_advantages
from miles_multilora.algo.config import AlgoConfig
from miles_multilora.algo.dynamic_sampling import DynamicSamplingResult, dynamic_sampling, is_informative
from miles_multilora.algo.losses import (
    PolicyLossOutput,
    adapter_normalizers,
    aggregate_per_adapter,
    kl_penalty,
    policy_loss,
)
from miles_multilora.algo.overlong import overlong_penalty

__all__ = [
    "AlgoConfig",
    "DynamicSamplingResult",
    "PolicyLossOutput",
    "adapter_normalizers",
    "aggregate_per_adapter",
    "dynamic_sampling",
    "group_advantages",
    "grpo_advantages",
    "is_informative",
    "kl_penalty",
    "overlong_penalty",
    "policy_loss",
]
