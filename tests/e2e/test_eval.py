"""Held-out evaluation on the tiny model: when it runs, what it reports, and that it never trains.

In-process trainer ranks (no Ray) for the step-level checks; one Ray run for metrics.jsonl, the
controller record and the reward plot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.controller.snapshot import SlotAssignment, Snapshot
from miles_multilora.launch.metrics import eval_points, reward_series
from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from miles_multilora.rl import checkpoint as ckpt
from tests.e2e.conftest import REPO_ROOT, final_checkpoint, snapshot_of, tiny_run_config, toy_adapter

TOY_EVAL = str(REPO_ROOT / "tests" / "e2e" / "data" / "toy_eval.jsonl")
# not the training's result: times, and the tenant's checkpoint bytes on disk (disk accounting of each
# run's own output directory, which the two runs compared here do not share)
TIMING_KEYS = {"tokens_per_s", "step_time_s", "reward/latency_s", "checkpoint/tenant_bytes"}


def _lower(steps: int, **eval_section: Any) -> dict[str, Any]:
    extra = {"eval": {"path": TOY_EVAL, "size": 16, **eval_section}} if eval_section else {}
    return toy_adapter("lower", "lowercase_majority", steps=steps, **extra)


def _digits(steps: int) -> dict[str, Any]:
    return toy_adapter("digits", "fraction_of_digits", steps=steps, batched=True)


@pytest.fixture
def make_worker(tmp_path: Path) -> Iterator[Any]:
    """Builds in-process trainer ranks one after the other (each tears down the previous one)."""
    made: list[RLStep] = []

    def make(specs: list[dict[str, Any]]) -> RLStep:
        if made:
            compat.destroy_distributed()
        made.append(RLStep.build(tiny_run_config(tmp_path / f"run{len(made)}", specs)))
        return made[-1]

    yield make
    if made:
        compat.destroy_distributed()


def _train(worker: RLStep, specs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    outs = []
    for i in range(steps):
        outs.append(worker.step(snapshot_of(i + 1, specs, worker.versions(), init=i == 0)))
        assert not outs[-1].failed, outs[-1].failed
    return outs


def _slot_state(worker: RLStep, name: str) -> dict[str, Any]:
    slot = worker.residents[name].slot
    weights = {
        n: p[slot].detach().clone()
        for n, p in worker.rank.model.named_parameters()
        if "lora_A" in n or "lora_B" in n
    }
    return {"weights": weights, "optimizer": worker.rank.optimizer.slot_state_dict(slot)}


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_eval_runs_every_n_steps_and_at_the_end_and_never_changes_training(make_worker: Any) -> None:
    steps = 5
    with_eval = [_lower(steps, every=2, samples=2, at_start=False), _digits(steps)]
    worker = make_worker(with_eval)
    outs = _train(worker, with_eval, steps)
    eval_steps = {
        name: [o.results[name].step for o in outs if "eval/size" in o.results[name].metrics]
        for name in ("lower", "digits")
    }
    assert eval_steps == {"lower": [2, 4, 5], "digits": []}  # every 2 steps, and the end (5)
    last = outs[-1].results["lower"].metrics
    assert last["eval/size"] == 10  # 12 rows, 2 of them training questions (skipped)
    assert {"eval/reward_mean", "eval/accuracy", "eval/pass@2"} <= last.keys()
    assert all(
        it.question not in worker.data.dataset("lower").questions()
        for it in worker.residents["lower"].eval_set.items
    )
    evaluated = (_slot_state(worker, "lower"), worker.data.adapter_state("lower"))
    eval_rewards = [o.results["lower"].metrics.get("eval/reward_mean") for o in outs]

    without_eval = [_lower(steps), _digits(steps)]
    plain = make_worker(without_eval)
    plain_outs = _train(plain, without_eval, steps)
    for o, p in zip(outs, plain_outs, strict=True):
        for name in ("lower", "digits"):
            m, q = o.results[name].metrics, p.results[name].metrics
            training = {k: v for k, v in m.items() if not k.startswith("eval/") and k not in TIMING_KEYS}
            assert training == {k: v for k, v in q.items() if k not in TIMING_KEYS}, name
    _assert_same(evaluated[0], _slot_state(plain, "lower"), "lower slot")
    assert evaluated[1] == plain.data.adapter_state("lower")
    assert any(r for r in eval_rewards), "eval rewards are all zero: the test would not see a change"


def _digits_with_eval(steps: int, **eval_section: Any) -> dict[str, Any]:
    section = {"path": TOY_EVAL, "size": 16, "every": 0, **eval_section}
    return toy_adapter("digits", "fraction_of_digits", steps=steps, batched=True, eval=section)


def _resume(spec: dict[str, Any], slot: int, checkpoint: Path) -> SlotAssignment:
    parsed = parse_adapter_spec(spec, max_rank=8)
    step = int(ckpt.read_state(checkpoint)["step"])
    return SlotAssignment(parsed.name, f"{parsed.name}-1", slot, parsed, step, str(checkpoint), True)


def test_eval_at_start_evaluates_the_fresh_slot_first_and_never_changes_training(
    make_worker: Any, tmp_path: Path
) -> None:
    steps = 3
    at_start = [_lower(steps, every=0, samples=2), _digits_with_eval(steps)]
    worker = make_worker(at_start)
    outs = [worker.step(snapshot_of(1, at_start, {}, init=True))]
    first = outs[0].results
    assert not outs[0].failed
    for name in ("lower", "digits"):  # the first step only evaluates, at version 0 (the fresh slot)
        assert first[name].trained is False and first[name].step == 0 and worker.version(name) == 0
        m = first[name].metrics
        assert m["step"] == m["version"] == 0 and "reward_mean" not in m
        assert {"eval/reward_mean", "eval/reward_mean_se", "eval/size"} <= m.keys()
    assert {"eval/accuracy", "eval/accuracy_se", "eval/pass@2"} <= first["lower"].metrics.keys()
    assert first["lower"].metrics["eval/pass@2_se"] > 0  # the base model gets some items right, not all
    after_eval = {name: worker.data.adapter_state(name) for name in ("lower", "digits")}
    for i in range(steps):  # then it trains from step 1, with no second step-0 eval
        outs.append(worker.step(snapshot_of(i + 2, at_start, worker.versions(), init=False)))
        assert not outs[-1].failed and all(r.trained for r in outs[-1].results.values())
    assert [o.results["lower"].step for o in outs] == [0, 1, 2, 3]
    evals = [o.results["lower"].step for o in outs if "eval/size" in o.results["lower"].metrics]
    assert evals == [0, 3]
    trained = {
        name: (_slot_state(worker, name), worker.data.adapter_state(name)) for name in ("lower", "digits")
    }

    plain_specs = [
        _lower(steps, every=0, samples=2, at_start=False),
        _digits_with_eval(steps, at_start=False),
    ]
    plain = make_worker(plain_specs)
    snapshot = snapshot_of(1, plain_specs, {}, init=True)
    for a in snapshot.running:
        plain.residents.ensure(a)
        assert plain.data.adapter_state(a.name) == after_eval[a.name]  # the step-0 eval drew no prompt
    plain_outs = _train(plain, plain_specs, steps)
    for o, p in zip(outs[1:], plain_outs, strict=True):
        for name in ("lower", "digits"):
            m, q = o.results[name].metrics, p.results[name].metrics
            assert {k: v for k, v in m.items() if k not in TIMING_KEYS} == {
                k: v for k, v in q.items() if k not in TIMING_KEYS
            }, name  # the same training, and the same final eval
    for name in ("lower", "digits"):
        _assert_same(trained[name][0], _slot_state(plain, name), f"{name} slot")
        assert trained[name][1] == plain.data.adapter_state(name)

    # a resumed adapter (past step 0) is not evaluated at start again: it trains at once
    longer = [_lower(steps + 1, every=0, samples=2), _digits_with_eval(steps + 1)]
    resumed = make_worker(longer)
    out_dir = Path(worker.cfg.trainer.output_dir)
    running = tuple(
        _resume(spec, slot, final_checkpoint(out_dir, spec["name"])) for slot, spec in enumerate(longer)
    )
    out = resumed.step(Snapshot(1, 2, running, (), ()))
    assert not out.failed
    assert {n: (r.trained, r.step) for n, r in out.results.items()} == {
        "lower": (True, steps + 1),
        "digits": (True, steps + 1),
    }


def test_a_failing_eval_fails_only_its_adapter(make_worker: Any, tmp_path: Path) -> None:
    missing = {"eval": {"path": str(tmp_path / "nope.jsonl")}}
    specs = [toy_adapter("broken", "fraction_of_lowercase", steps=3, **missing), _digits(3)]
    worker = make_worker(specs)
    out = worker.step(snapshot_of(1, specs, {}, init=True))
    assert "eval.path" in out.failed["broken"] and "nope.jsonl" in out.failed["broken"]
    assert out.results["digits"].trained and "broken" not in worker.residents

    specs = [_lower(3, every=2, at_start=False), _digits(3)]
    worker = make_worker(specs)
    _train(worker, specs, 1)
    worker.residents["lower"].eval_set.items[0].prompt = None  # type: ignore[assignment]  # cannot be encoded
    out = worker.step(snapshot_of(2, specs, worker.versions(), init=False))
    assert out.failed["lower"].startswith("preparing its eval requests")
    assert set(out.results) == {"digits"} and out.results["digits"].trained
    assert "lower" not in worker.residents  # its record, eval set included, is gone


def test_training_run_reports_eval_in_metrics_the_record_and_the_plot(
    tmp_path: Path, ray_session: None
) -> None:
    from miles_multilora.launch.run import run_training

    out = tmp_path / "run"
    cfg = tiny_run_config(out, [_lower(3, every=2), _digits(3)], logging={"plot": True})
    records = run_training(cfg)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {(r["adapter"], r["step"]) for r in rows if "eval/reward_mean" in r}
    assert evals == {("lower", 0), ("lower", 2), ("lower", 3)}  # eval.at_start by default, every 2, the end
    assert all("step/eval_s" in r for r in rows)
    step0 = [r for r in rows if r["adapter"] == "lower" and r["step"] == 0]
    assert len(step0) == 1 and step0[0]["global_step"] == 0 and "reward_mean" not in step0[0]
    last = records["lower"]["last_eval"]
    assert last["step"] == 3 and last["size"] == 10 and {"reward_mean", "accuracy"} <= last.keys()
    assert {"reward_mean_se", "accuracy_se"} <= last.keys()
    assert records["digits"]["last_eval"] is None
    png = out / "rewards.png"
    assert png.is_file() and png.stat().st_size > 0
    train, held_out = reward_series(rows)
    assert [s for s, _ in held_out["lower"]] == [0, 2, 3] and "digits" not in held_out
    assert all(p.se is not None for p in eval_points(rows)["lower"])  # 10 items: every eval has its SE
    assert [s for s, _ in train["lower"]] == [1, 2, 3] and [s for s, _ in train["digits"]] == [1, 2, 3]


def test_two_tensor_parallel_ranks_evaluate_in_agreement(tmp_path: Path, ray_session: None) -> None:
    from miles_multilora.launch.run import run_training

    out = tmp_path / "tp2"
    adapters = [_lower(3, every=2, samples=2), _digits(3)]
    cfg = tiny_run_config(out, adapters, trainer={"world_size": 2}, model={"source": "tiny", "tp": 2})
    records = run_training(cfg)
    assert {n: (r["state"], r["step"]) for n, r in records.items()} == {
        "lower": ("DONE", 3),
        "digits": ("DONE", 3),
    }
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {(r["adapter"], r["step"]) for r in rows if "eval/pass@2" in r} == {
        ("lower", 0),
        ("lower", 2),
        ("lower", 3),
    }
    assert records["lower"]["last_eval"]["step"] == 3
