"""Held-out evaluation in the RL step: when an adapter is due, and its eval at its current weights.

Eval draws nothing from the data source, runs no forward with gradients and has its own reward
manager (its own failure counters), so a run's training is the same with or without it. Its
rewards arrive on their own time like training's (:mod:`miles_multilora.rl.scoring`): an eval
whose rewards are not in within ``trainer.reward_wait_s`` is reported with a later step's result.
"""

from __future__ import annotations

from typing import Any

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.data.evaluation import eval_metrics
from miles_multilora.data.records import PromptItem
from miles_multilora.rl.adapters import ResidentAdapter, Residents
from miles_multilora.rl.faults import AdapterFailures
from miles_multilora.rl.rollout import build_groups, generate, sample_requests
from miles_multilora.rl.scoring import PendingRewards
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
    residents: Residents,
    names: list[str],
    pending: PendingRewards,
    failures: AdapterFailures,
    idle: bool = False,
) -> dict[str, dict[str, Any]]:
    """Held-out eval of ``names`` at their current weights, all in one generation, scored in the
    background (an adapter whose last eval is still being scored is left out); a collective.
    ``idle``: the step has nothing else to do (it waits up to the wait for an earlier eval).

    Returns ``{name: eval/* metrics}`` of the evals whose rewards are in (this step's or earlier
    ones'; the latest when both are); an adapter whose eval cannot be prepared (or whose eval
    reward failed too often) is added to ``failures``.
    """
    out = _arrived(residents, pending, failures, idle and not names)  # earlier (late) evals
    names = [n for n in names if not pending.busy(n)]
    items = {name: residents[name].eval_set.items for name in names}  # type: ignore[union-attr]
    groups = build_groups(residents, items, eval_requests, failures, "preparing its eval requests")
    failures.agree()  # every rank evaluates the same adapters
    groups = [g for g in groups if g.adapter not in failures]
    if groups:
        groups = generate(residents, groups, failures)  # a request the engine refuses fails its adapter
    if groups:
        for name in dict.fromkeys(g.adapter for g in groups):
            residents[name].evaluated = residents.version(name)
        pending.submit(groups)
        out.update(_arrived(residents, pending, failures))
    return out


def _arrived(
    residents: Residents, pending: PendingRewards, failures: AdapterFailures, idle: bool = False
) -> dict[str, dict[str, Any]]:
    """The eval metrics of the adapters whose eval rewards are in (a collective)."""
    arrived, reports = pending.collect(idle=idle)
    out: dict[str, dict[str, Any]] = {}
    for name, report in reports.items():
        mine = [g for g in arrived if g.adapter == name]
        adapter = residents[name]
        assert adapter.spec.eval is not None
        if report.rewards is None:
            error = report.error or "eval reward failed"
            out[name] = {"eval/size": len(mine), "eval/error": error}
            if report.failed:
                failures.fail(name, f"eval: {report.error or 'reward failed'}")
            continue
        out[name] = eval_metrics(
            [g.rewards for g in mine], [g.correct for g in mine], adapter.spec.eval.samples
        )
    for name, metrics in out.items():  # the step evaluated (a late eval is reported at a later one)
        metrics["eval/step"] = residents[name].evaluated
    return out
