"""Rollouts of the RL recipe: prompt groups, their requests, samples and rewards.

A :class:`Group` is one prompt of one adapter with its requests, built once (seeded per adapter,
prompt and sample, so every rank builds the same ones), then its results and rewards, attached to
it. :func:`build_groups` turns drawn prompts into groups (an adapter whose prompts cannot be
encoded or served fails alone), :func:`generate` samples every group on the trainer rank (DP-sharded
there); :mod:`miles_multilora.rl.scoring` rewards them on rank 0 and hands every rank their rewards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.data.records import PromptItem
from miles_multilora.data.reward_manager import AdapterRewards
from miles_multilora.errors import SpecError
from miles_multilora.rl.adapters import ResidentAdapter, Residents
from miles_multilora.rl.faults import AdapterFailures
from miles_multilora.rollout import GenerationRequest, GenerationResult, RolloutError
from miles_multilora.trainer.tokenizer import encode_prompt

# the requests of one prompt: (adapter, its version, prompt ids, item) -> requests
RequestsOf = Callable[[ResidentAdapter, int, list[int], PromptItem], list[GenerationRequest]]


@dataclass
class Group:
    """One prompt's samples for one adapter (a GRPO group): requests, then results and rewards."""

    adapter: str
    item: PromptItem
    requests: list[GenerationRequest]
    results: list[GenerationResult] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # empty when scoring failed
    correct: list[bool | None] = field(default_factory=list)


def request_seed(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def sample_requests(
    adapter: ResidentAdapter,
    version: int,
    prompt_ids: list[int],
    item: PromptItem,
    n: int,
    sampling: SamplingSpec,
    **metadata: Any,
) -> list[GenerationRequest]:
    """``n`` requests for ``item`` at ``version`` of ``adapter``, seeded per prompt and sample."""
    return [
        GenerationRequest(
            adapter=adapter.name,
            slot=adapter.slot,
            version=version,
            prompt_ids=prompt_ids,
            sampling=sampling,
            seed=request_seed(adapter.spec.seed, item.uid, j),
            metadata={"uid": item.uid, "sample": j, **metadata},
        )
        for j in range(n)
    ]


def training_requests(
    adapter: ResidentAdapter, version: int, prompt_ids: list[int], item: PromptItem
) -> list[GenerationRequest]:
    """``n_samples_per_prompt`` requests with the adapter's sampling."""
    spec = adapter.spec
    return sample_requests(adapter, version, prompt_ids, item, spec.n_samples_per_prompt, spec.sampling)


def build_groups(
    residents: Residents,
    batch: dict[str, list[PromptItem]],
    requests_of: RequestsOf,
    failures: AdapterFailures,
    stage: str = "preparing its generation requests",
) -> list[Group]:
    """The groups of ``batch`` (adapter -> prompts), each with its requests, checked by the engine.
    An adapter whose prompts cannot be encoded or whose requests cannot be served fails alone."""
    rank = residents.rank
    groups = []
    for name, items in batch.items():
        try:
            adapter = residents[name]
            budget = rank.max_seq_len - 1 - adapter.spec.sampling.max_new_tokens
            if budget < 1:
                raise SpecError(
                    "sampling.max_new_tokens", f"leaves no room for the prompt in {rank.max_seq_len}"
                )
            version = residents.version(name)
            mine = []
            for item in items:
                prompt_ids = encode_prompt(rank.tokenizer, item.prompt)[-budget:]
                mine.append(Group(name, item, requests_of(adapter, version, prompt_ids, item)))
            for group in mine:
                for request in group.requests:
                    rank.check_request(request)
        except Exception as exc:  # noqa: BLE001 - isolated per adapter
            failures.add(name, stage, exc)
            continue
        groups.extend(mine)
    return groups


def generate(residents: Residents, groups: list[Group], failures: AdapterFailures) -> list[Group]:
    """Sample every group (each on one DP rank; every rank gets every result); returns the groups
    sampled. A group that fails the engine call alone (:meth:`~miles_multilora.trainer.rank.TrainerRank.sample`)
    fails its adapter (the same on every rank), whose groups are left out."""
    for group, results in zip(groups, residents.rank.sample([g.requests for g in groups]), strict=True):
        if isinstance(results, RolloutError):
            failures.add(group.adapter, "generating its samples", results)
        else:
            group.results = results
    return [g for g in groups if g.adapter not in failures]


@dataclass
class Rollout:
    """A step's rollout: the groups that train (after dynamic sampling), each adapter's reward
    report of its first batch, and each adapter's dynamic-sampling metrics."""

    groups: list[Group] = field(default_factory=list)
    rewards: dict[str, AdapterRewards] = field(default_factory=dict)
    sampling: dict[str, dict[str, float]] = field(default_factory=dict)
