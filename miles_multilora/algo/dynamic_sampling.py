"""DAPO dynamic sampling: drop prompt groups whose rewards are all equal and refill per adapter.

A group whose samples all got the same reward has zero advantage everywhere and teaches
nothing. :func:`dynamic_sampling` keeps the informative groups of each adapter and asks the
caller's ``generate`` callback (rollout + reward of fresh prompts from the same adapter's data)
for more, in rounds, until every adapter has its target number of groups or the round limit is hit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

G = TypeVar("G")


def is_informative(rewards: Sequence[float], tol: float = 1e-8) -> bool:
    """True when the group's rewards are not all equal (within ``tol``)."""
    values = [float(r) for r in rewards]
    return len(values) > 1 and max(values) - min(values) > tol


@dataclass
class DynamicSamplingResult(Generic[G]):
    """Kept groups per adapter (at most the target) plus what it took to get them."""

    groups: dict[str, list[G]]
    rounds: int  # refill rounds run (0 = the first batch was enough)
    generated: dict[str, int] = field(
        default_factory=dict
    )  # groups scored per adapter, incl. the first batch
    dropped: dict[str, int] = field(default_factory=dict)  # all-equal groups dropped per adapter
    short: dict[str, int] = field(default_factory=dict)  # adapters still below target: missing groups

    def metrics(self, adapter: str) -> dict[str, float]:
        generated = self.generated.get(adapter, 0)
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/generated_groups": float(generated),
            "dynamic_sampling/dropped_groups": float(self.dropped.get(adapter, 0)),
            "dynamic_sampling/kept_groups": float(len(self.groups.get(adapter, []))),
            "dynamic_sampling/drop_frac": self.dropped.get(adapter, 0) / generated if generated else 0.0,
        }


def dynamic_sampling(
    groups: Mapping[str, Sequence[G]],
    targets: Mapping[str, int],
    generate: Callable[[dict[str, int]], Mapping[str, Sequence[G]]],
    max_refill_rounds: int,
    rewards_of: Callable[[G], Sequence[float]] = lambda g: g.rewards,  # type: ignore[attr-defined]
    tol: float = 1e-8,
) -> DynamicSamplingResult[G]:
    """Filter each adapter's groups and refill the ones below target.

    ``groups``: adapter -> scored groups of this step. ``targets``: adapter -> groups wanted
    (usually ``prompts_per_step``; adapters missing from ``targets`` want all they have).
    ``generate({adapter: k})`` must return, per adapter, up to ``k`` freshly generated and scored
    groups (fewer or none when its data ran out). Each round asks only for what is missing; an
    adapter for which ``generate`` returns nothing is not asked again. Extra informative groups
    beyond the target are dropped (in order of arrival).
    """
    if max_refill_rounds < 0:
        raise ValueError("max_refill_rounds must be >= 0")
    kept: dict[str, list[G]] = {}
    generated: dict[str, int] = {}
    dropped: dict[str, int] = {}
    want = {name: int(targets.get(name, len(gs))) for name, gs in groups.items()}

    def absorb(name: str, new: Sequence[G]) -> None:
        generated[name] = generated.get(name, 0) + len(new)
        bucket = kept.setdefault(name, [])
        for group in new:
            if is_informative(rewards_of(group), tol):
                if len(bucket) < want[name]:
                    bucket.append(group)
            else:
                dropped[name] = dropped.get(name, 0) + 1

    for name, gs in groups.items():
        absorb(name, gs)

    exhausted: set[str] = set()
    rounds = 0
    while rounds < max_refill_rounds:
        missing = {
            name: want[name] - len(kept[name])
            for name in kept
            if len(kept[name]) < want[name] and name not in exhausted
        }
        if not missing:
            break
        rounds += 1
        fresh = generate(dict(missing))
        for name in missing:
            new = list(fresh.get(name, ()))
            if not new:
                exhausted.add(name)
            absorb(name, new)
    short = {name: want[name] - len(kept[name]) for name in kept if len(kept[name]) < want[name]}
    return DynamicSamplingResult(
        groups=kept, rounds=rounds, generated=generated, dropped=dropped, short=short
    )
