"""RL algorithms: GRPO/DAPO advantages, dynamic sampling, per-slot policy loss and KL."""

from miles_multilora.algo.advantages import group_advantages, grpo_advantages
from miles_multilora.algo.config import AlgoConfig
from miles_multilora.algo.dynamic_sampling import DynamicSamplingResult, dynamic_sampling, is_informative
from miles_multilora.algo.losses import (
    PolicyLossOutput,
    aggregate_per_slot,
    kl_penalty,
    policy_loss,
    slot_normalizers,
)
from miles_multilora.algo.overlong import overlong_penalty

__all__ = [
    "AlgoConfig",
    "DynamicSamplingResult",
    "PolicyLossOutput",
    "aggregate_per_slot",
    "dynamic_sampling",
    "group_advantages",
    "grpo_advantages",
    "is_informative",
    "kl_penalty",
    "overlong_penalty",
    "policy_loss",
    "slot_normalizers",
]
