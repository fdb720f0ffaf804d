"""The RL step's orchestration against a fake trainer rank (plain Python, no model): budgets,
checkpoint and eval cadence, dynamic sampling, adapters that stop updating, and ranks that agree
on every adapter's failure. The real controller core drives it, as the driver loop does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from miles_multilora.controller import ControllerCore, StepReport
from miles_multilora.disk_usage import dir_size
from miles_multilora.rl import RLStep
from miles_multilora.rl import checkpoint_layout as layout
from miles_multilora.rollout import GenerationRequest
from tests.e2e.conftest import REPO_ROOT, TOY_PROMPTS, tiny_run_config
from tests.fake_rank import FakeRank, FakeWorld, alternating

TOY_EVAL = str(REPO_ROOT / "tests" / "e2e" / "data" / "toy_eval.jsonl")


def adapter(name: str, steps: int, **overrides: Any) -> dict[str, Any]:
    """A spec on the toy prompts whose reward (exact match with ``"a"``) runs in the trainer."""
    return {
        "name": name,
        "rank": 4,
        "alpha": 8,
        "dataset": {"path": TOY_PROMPTS, "seed": 0},
        "prompt": {"template": "{question}:", "use_chat_template": False},
        "reward": {"type": "exact_match", "extract": "none"},
        "n_samples_per_prompt": 4,
        "prompts_per_step": 2,
        "num_steps": steps,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "save_interval": 0,
        "seed": 1,
        **overrides,
    }


def start(
    tmp_path: Path, specs: list[dict[str, Any]], ranks: int = 1, **sections: Any
) -> tuple[ControllerCore, list[RLStep], list[FakeRank]]:
    cfg = tiny_run_config(tmp_path / "out", specs, lora={"num_slots": 4, "max_rank": 8}, **sections)
    core = ControllerCore(num_slots=4, max_rank=8)
    for spec in specs:
        core.register(spec)
    world = FakeWorld(ranks) if ranks > 1 else None
    fakes = [FakeRank(world, i) for i in range(ranks)]
    return core, [RLStep(fake, cfg) for fake in fakes], fakes


def drive(core: ControllerCore, steps: list[RLStep]) -> list[StepReport] | None:
    """One step of the controller's snapshot on every rank (threads), rank 0's report applied to
    the controller as the driver loop applies it; None when nothing is left to do."""
    snapshot = core.snapshot()
    if not snapshot.adapters and not snapshot.slots_to_clear:
        return None
    with ThreadPoolExecutor(len(steps)) as pool:
        reports = list(pool.map(lambda rl: rl.step(snapshot), steps))
    apply(core, reports[0])
    return reports


def apply(core: ControllerCore, report: StepReport) -> None:
    """Rank 0's step report applied to the controller, as the driver loop applies it."""
    core.apply_report(report)


def run(core: ControllerCore, steps: list[RLStep], limit: int = 20) -> list[StepReport]:
    reports = []
    for _ in range(limit):
        out = drive(core, steps)
        if out is None:
            return reports
        reports.append(out[0])
    raise AssertionError(f"still running after {limit} steps")


def history(reports: list[StepReport], name: str) -> list[tuple[int | None, bool, bool, str | None]]:
    """``name``'s (step, trained, evaluated, checkpoint) in every step that reported it."""
    return [
        (r.step, r.trained, "eval/size" in r.metrics, r.checkpoint)
        for report in reports
        if (r := report.results.get(name)) is not None
    ]


def test_budgets_checkpoints_and_evals_keep_their_cadence(tmp_path: Path) -> None:
    every_two = {"path": TOY_EVAL, "size": 4, "every": 2, "at_start": False}
    specs = [
        adapter("a", 4, save_interval=2, eval=every_two),
        adapter("b", 2),
        adapter("c", 1, eval={"path": TOY_EVAL, "size": 4, "every": 0}),  # at_start (the default)
    ]
    core, steps, (fake,) = start(tmp_path, specs)
    reports = run(core, steps)

    ckpts = {n: [p.name for p in layout.complete_checkpoints(layout.run_dir(tmp_path / "out", n, f"{n}-{i + 1}"))]
             for i, n in enumerate("abc")}  # fmt: skip
    a_final = str(layout.run_dir(tmp_path / "out", "a", "a-1") / "step_000004")
    assert history(reports, "a") == [
        (1, True, False, None),
        (2, True, True, str(layout.run_dir(tmp_path / "out", "a", "a-1") / "step_000002")),
        (3, True, False, None),
        (4, True, True, a_final),  # the end: evaluated, checkpointed once
    ]
    assert [(s, t, e) for s, t, e, _ in history(reports, "b")] == [(1, True, False), (2, True, False)]
    assert [(s, t, e) for s, t, e, _ in history(reports, "c")] == [(0, False, True), (1, True, True)]
    assert ckpts == {"a": ["step_000002", "step_000004"], "b": ["step_000002"], "c": ["step_000001"]}
    assert [sorted(r.finished) for r in reports] == [[], ["b", "c"], [], ["a"], []]
    assert reports[3].finished["a"] == a_final and not any(r.failed for r in reports)
    records = {r["name"]: r for r in core.list()}
    assert {n: (r["state"], r["step"]) for n, r in records.items()} == {
        "a": ("DONE", 4),
        "b": ("DONE", 2),
        "c": ("DONE", 1),
    }
    assert records["a"]["last_checkpoint"] == a_final
    a_bytes = dir_size(layout.run_dir(tmp_path / "out", "a", "a-1"))  # its tenant's: its own name
    assert records["a"]["metrics"][-1]["checkpoint/tenant_bytes"] == a_bytes  # what `status a` shows
    per_step = [r.metrics.get("checkpoint/tenant_bytes") for rep in reports if (r := rep.results.get("a"))]
    assert per_step[0] is None and per_step[1] > 0 and per_step[2] is None and per_step[3] == a_bytes
    assert [r.cleared for r in reports] == [(), (), (1, 2), (), (0,)]  # each slot once its adapter is done
    assert {0, 1, 2} <= set(fake.closed) and not reports[-1].results
    assert not steps[0].residents.get("a") and fake.slots == {}
    # every adapter's prompts were sampled at the version it was at (the fake checks each request)
    assert {tuple(sorted(set(call))) for call in fake.sampled} >= {("a", "b", "c"), ("a", "b")}


def test_dynamic_sampling_refills_and_an_adapter_without_signal_fails(tmp_path: Path) -> None:
    seen: dict[str, int] = {}

    def answer(request: GenerationRequest) -> str:
        if request.adapter == "flat":
            return "a"  # every sample right: no group carries a signal
        order = seen.setdefault(request.metadata["uid"], len(seen))
        return "a" if order % 2 == 0 else alternating(request)  # every other prompt is flat

    specs = [adapter("mixed", 3), adapter("flat", 3)]
    core, steps, (fake,) = start(
        tmp_path,
        specs,
        trainer={"max_skipped_steps": 2},
        algo={"dynamic_sampling": True, "max_refill_rounds": 3},
    )
    fake.answer = answer
    first = drive(core, steps)[0]  # type: ignore[index]
    mixed, flat = first.results["mixed"].metrics, first.results["flat"].metrics
    assert first.results["mixed"].trained and mixed["dynamic_sampling/kept_groups"] == 2
    assert (mixed["dynamic_sampling/generated_groups"], mixed["dynamic_sampling/dropped_groups"]) == (4, 2)
    assert mixed["reward_mean"] == 0.5  # only the kept (informative) groups train and count
    assert not first.results["flat"].trained and flat["dynamic_sampling/kept_groups"] == 0
    assert flat["dynamic_sampling/rounds"] == 3 and not first.failed
    second = drive(core, steps)[0]  # type: ignore[index]
    assert second.results["mixed"].trained and second.results["mixed"].step == 2
    assert "no update in 2 consecutive steps (trainer.max_skipped_steps)" in second.failed["flat"]
    assert "dynamic sampling kept none" in second.failed["flat"]
    assert core.get("flat")["state"] == "FAILED" and core.get("mixed")["state"] == "RUNNING"


def test_a_vetoed_optimizer_step_moves_nothing_and_fails_the_adapter_in_time(tmp_path: Path) -> None:
    core, steps, (fake,) = start(
        tmp_path, [adapter("healthy", 5), adapter("nan", 5)], trainer={"max_skipped_steps": 2}
    )
    fake.non_finite = {1}  # nan's slot: its gradient is not finite, every step
    first = drive(core, steps)[0]  # type: ignore[index]
    assert first.results["healthy"].trained and not first.results["nan"].trained
    assert first.results["nan"].metrics["skipped"] == 1.0 and steps[0].version("nan") == 0
    assert not first.failed
    second = drive(core, steps)[0]  # type: ignore[index]
    assert "not finite" in second.failed["nan"] and "sampling.temperature" in second.failed["nan"]
    assert second.results["healthy"].step == 2 and steps[0].version("healthy") == 2
    third = drive(core, steps)[0]  # type: ignore[index]
    assert third.cleared == (1,) and set(third.results) == {"healthy"} and "nan" not in steps[0].residents


def test_ranks_agree_on_every_adapter_failure(tmp_path: Path) -> None:
    """Failures seen on one rank only (a request its server refuses, a checkpoint its disk cannot
    take) fail the adapter on every rank, with that rank's reason; the ranks go on as one."""
    specs = [adapter("a", 3), adapter("b", 3), adapter("c", 3, save_interval=1)]
    core, steps, (rank0, rank1) = start(tmp_path, specs, ranks=2)
    rank1.refuse = lambda q: "LoRA rank 4 is greater than max_lora_rank 2" if q.adapter == "b" else None
    rank1.fail_save = lambda opened: opened.name == "c"
    reports = drive(core, steps)
    assert reports is not None
    for report in reports:
        assert set(report.failed) == {"b", "c"}
        assert report.failed["b"].startswith("preparing its generation requests: RolloutError: LoRA rank 4")
        assert report.failed["c"].startswith(
            "writing checkpoint step 1 on rank 1: OSError: disk full on rank 1"
        )
        assert {n: (r.step, r.trained) for n, r in report.results.items()} == {"a": (1, True)}
    assert rank0.sampled == rank1.sampled == [["a", "a", "c", "c"]]  # b dropped on both before sampling
    assert reports[0].results["a"].metrics.keys() == reports[1].results["a"].metrics.keys()
    assert [sorted(rl.residents) for rl in steps] == [["a"], ["a"]]  # the failed ones forgotten on both

    reports = drive(core, steps)  # the controller cleared their slots; a trains on, alone
    assert reports is not None and all(r.cleared == (1, 2) and set(r.results) == {"a"} for r in reports)
    assert [rl.version("a") for rl in steps] == [2, 2]
    assert {n: r["state"] for n, r in ((r["name"], r) for r in core.list())} == {
        "a": "RUNNING",
        "b": "FAILED",
        "c": "FAILED",
    }


def test_adapters_that_swap_slots_start_again_in_their_new_ones(tmp_path: Path) -> None:
    """A restored controller may grant the resident adapters other slots (all ``needs_init``): each
    one starts in its new slot, and the one that held it before lets go first."""
    from tests.e2e.conftest import snapshot_of

    specs = [adapter("a", 5), adapter("b", 5)]
    _, (rl,), (fake,) = start(tmp_path, specs)
    first = rl.step(snapshot_of(1, specs))
    assert {n: r.step for n, r in first.results.items()} == {"a": 1, "b": 1}
    swapped = rl.step(snapshot_of(2, specs[::-1], init=True))  # b -> slot 0, a -> slot 1, fresh
    assert not swapped.failed and {n: r.step for n, r in swapped.results.items()} == {"a": 1, "b": 1}
    assert {s: o.name for s, o in fake.slots.items()} == {0: "b", 1: "a"}
    assert (rl.residents["a"].slot, rl.residents["b"].slot) == (1, 0)


def test_a_late_reward_trains_at_a_later_step_and_the_ranks_agree(tmp_path: Path) -> None:
    """Rewards that arrive after ``trainer.reward_wait_s``: the step goes on with the others, and the
    late adapter's groups train at a later step (generated once, none lost), alike on both ranks."""
    slow = adapter("slow", 2, reward={"type": "tests.e2e.toy_rewards:slow_lowercase", "batched": True})
    core, steps, (rank0, rank1) = start(
        tmp_path, [adapter("a", 6), slow], ranks=2, trainer={"reward_wait_s": 0.1}
    )
    reports = []
    try:
        while (both := drive(core, steps)) is not None and len(reports) < 200:
            trained = [{n: (r.step, r.trained) for n, r in rep.results.items()} for rep in both]
            assert trained[0] == trained[1] and both[0].failed == both[1].failed == {}
            reports.append(both[0])
    finally:
        for rl in steps:
            rl.rewards.close()
    stepped = [sorted(n for n, r in rep.results.items() if r.trained) for rep in reports]
    assert next(s for s in stepped if s) == ["a"]  # a trained while the slow one's rewards were out
    assert sum("slow" in s for s in stepped) == 2 and sum("a" in s for s in stepped) == 6
    assert core.get("slow")["state"] == core.get("a")["state"] == "DONE"
    assert rank0.sampled == rank1.sampled
    assert sum(g == "slow" for call in rank0.sampled for g in call) == 2 * 2  # 2 steps of 2 prompts, once


def test_a_late_eval_is_reported_later_and_its_adapter_ends_once_it_is_in(tmp_path: Path) -> None:
    """Held-out eval rewards arrive on their own time too: a slow eval does not hold the step (the
    other adapter trains on), its metrics come with a later result of its adapter, and an adapter
    whose final eval is still being scored ends (DONE, with that eval) once it is in."""
    slow = adapter(
        "slow",
        1,
        reward={"type": "tests.e2e.toy_rewards:slow_lowercase", "batched": True},
        eval={"path": TOY_EVAL, "size": 4, "every": 0},  # at the start and at the end
    )
    core, steps, _ = start(tmp_path, [adapter("a", 6), slow], trainer={"reward_wait_s": 0.1})
    reports = []
    try:
        for _ in range(200):
            out = drive(core, steps)
            if out is None:
                break
            reports.append(out[0])
    finally:
        for rl in steps:
            rl.rewards.close()
            rl.eval_rewards.close()
    a_trained = next(i for i, r in enumerate(reports) if r.results.get("a") and r.results["a"].trained)
    evaluated = [
        i for i, r in enumerate(reports) if "eval/size" in getattr(r.results.get("slow"), "metrics", {})
    ]
    assert a_trained < evaluated[0]  # a trained while the slow one's step-0 eval was being scored
    slow_results = [r.results["slow"] for r in reports if "slow" in r.results]
    evals = [r.metrics for r in slow_results if "eval/size" in r.metrics]
    assert len(evals) == 2 and "eval/error" not in evals[0]  # the start's and the end's, both in
    assert [m["eval/step"] for m in evals] == [0, 1]  # the steps evaluated, whenever they were reported
    assert "eval/size" in slow_results[-1].metrics  # its final result carries its final eval
    assert core.get("slow")["state"] == core.get("a")["state"] == "DONE" and core.get("slow")["step"] == 1
    assert not any(r.failed for r in reports)
