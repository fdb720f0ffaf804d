"""Per-adapter data: dataset loading, prompt rendering, the interleaving data source and rewards."""

from miles_multilora.data.datasets import AdapterDataset, load_adapter_dataset, load_hf_dataset
from miles_multilora.data.interleave import RoundRobinPolicy, WeightedPolicy, make_policy
from miles_multilora.data.prompts import render_prompt
from miles_multilora.data.records import DatasetRow, PromptItem, RewardSample
from miles_multilora.data.reward_manager import AdapterRewards, RewardManager, call_with_timeout
from miles_multilora.data.rewards import BUILTIN_REWARDS, RewardFunction, RewardOutput, build_reward
from miles_multilora.data.source import MultiLoRADataSource
from miles_multilora.data.validation import validate_adapter_resources

__all__ = [
    "BUILTIN_REWARDS",
    "AdapterDataset",
    "AdapterRewards",
    "DatasetRow",
    "MultiLoRADataSource",
    "PromptItem",
    "RewardFunction",
    "RewardManager",
    "RewardOutput",
    "RewardSample",
    "RoundRobinPolicy",
    "WeightedPolicy",
    "build_reward",
    "call_with_timeout",
    "load_adapter_dataset",
    "load_hf_dataset",
    "make_policy",
    "render_prompt",
    "validate_adapter_resources",
]
