"""Held-out evaluation in the RL step: when an adapter is due, and its eval at its current weights.

Eval draws nothing from the data source, runs no forward with gradients and has its own reward
manager (its own failure counters), so a run's training is the same with or without it.
"""

from __future__ import annotations

from typing import Any

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.data import RewardManager
from miles_multilora.data.evaluation import eval_metrics
from miles_multilora.data.records import PromptItem
from miles_multilora.rl.adapters import ResidentAdapter, Residents
from miles_multilora.rl.faults import AdapterFailures
from miles_multilora.rl.rollout import build_groups, generate, sample_requests, score
from miles_multilora.rollout import GenerationRequest


def start_eval_due(adapter: ResidentAdapter, version: int) -> bool:
    """``eval.at_start``: an adapter at step 0 not yet evaluated there gets its step-0 eval first
    (a resumed adapter is past step 0, so it is not evaluated at start again)."""
    ev = adapter.spec.eval
    return (
        ev is not None
        and ev.at_start
        and adapter.eval_set is not None
        and version == 0
        and adapter.evaluated != 0
    )


def eval_due(adapter: ResidentAdapter, version: int, trained: bool, done: bool) -> bool:
    """After every ``eval.every``-th trained step and at the end, once per version."""
    ev = adapter.spec.eval
    if ev is None or adapter.eval_set is None or adapter.evaluated == version:
        return False
    return done or (trained and ev.every > 0 and version % ev.every == 0)


def eval_requests(
    adapter: ResidentAdapter, version: int, prompt_ids: list[int], item: PromptItem
) -> list[GenerationRequest]:
    """k requests per eval item: greedy for k = 1, else the adapter's sampling; fixed seeds."""
    spec = adapter.spec
    assert spec.eval is not None
    sampling = spec.sampling
    if spec.eval.samples == 1:
        sampling = SamplingSpec(
            temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop=list(sampling.stop)
        )
    return sample_requests(adapter, version, prompt_ids, item, spec.eval.samples, sampling, eval=True)


def evaluate(
    residents: Residents, names: list[str], rewards: RewardManager, failures: AdapterFailures
) -> dict[str, dict[str, Any]]:
    """Held-out eval of ``names`` at their current weights, all in one generation.

    Returns ``{name: eval/* metrics}``; an adapter whose eval cannot be prepared (or whose eval
    reward failed too often) is added to ``failures``.
    """
    items = {name: residents[name].eval_set.items for name in names}  # type: ignore[union-attr]
    groups = build_groups(residents, items, eval_requests, failures, "preparing its eval requests")
    failures.agree()  # every rank evaluates the same adapters
    groups = [g for g in groups if g.adapter not in failures]
    if not groups:
        return {}
    groups = generate(residents, groups, failures)
    if not groups:
        return {}
    reports = score(residents, groups, rewards)
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(g.adapter for g in groups):
        mine = [g for g in groups if g.adapter == name]
        adapter, report = residents[name], reports.get(name)
        assert adapter.spec.eval is not None
        adapter.evaluated = residents.version(name)
        if report is None or report.rewards is None:
            error = (report.error if report is not None else None) or "eval reward failed"
            out[name] = {"eval/size": len(mine), "eval/error": error}
            if report is not None and report.failed:
                failures.fail(name, f"eval: {report.error or 'reward failed'}")
            continue
        out[name] = eval_metrics(
            [g.rewards for g in mine], [g.correct for g in mine], adapter.spec.eval.samples
        )
    return out
