"""The driver hands a step's report to the controller in two parts around the metrics rows: a
client that sees an adapter end (DONE, FAILED, CANCELLED) finds all its rows already written."""

from __future__ import annotations

from pathlib import Path

from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.snapshot import AdapterResult, StepReport
from miles_multilora.launch.loop import apply_and_log
from miles_multilora.launch.metrics import MetricsLogger, read_metrics


def _spec(name: str) -> dict:
    return {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 1}


def test_adapters_end_only_after_their_rows_are_written(tmp_path: Path) -> None:
    core = ControllerCore(num_slots=3, max_rank=16)
    for name in ("done", "failed", "drain"):
        core.register(_spec(name))
    core.snapshot()
    core.cancel("drain")
    logger = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False, plot=False), tmp_path)
    seen = []  # at each call: the adapters' states, and the rows already in the file

    def apply(part: StepReport) -> dict[str, dict[str, float]]:
        rows = {(r["adapter"], r["step"]) for r in read_metrics(logger.jsonl_path)}
        seen.append(({n: core.get(n)["state"] for n in ("done", "failed", "drain")}, rows))
        return core.apply_report(part)

    report = StepReport(
        snapshot_id=core.snapshot().snapshot_id,
        results={
            "done": AdapterResult(trained=True, step=1, metrics={"step": 1, "reward_mean": 0.5}),
            "failed": AdapterResult(trained=True, step=1, metrics={"step": 1, "reward_mean": 0.0}),
        },
        finished={"done": "/ckpt/done/final"},
        failed={"failed": "reward raised 3 times"},
        drained={"drain": "/ckpt/drain/final"},
        cleared=(),
        timing={"step_s": 1.0},
    )
    assert apply_and_log(apply, logger, report, 7, lambda: (2, 3))
    (first_states, first_rows), (second_states, second_rows) = seen
    assert set(first_states.values()) == {"RUNNING", "DRAINING"} and first_rows == set()
    assert set(second_states.values()) == {"RUNNING", "DRAINING"}  # still running: the rows came first
    assert second_rows == {("done", 1), ("failed", 1)}
    assert [core.get(n)["state"] for n in ("done", "failed", "drain")] == ["DONE", "FAILED", "CANCELLED"]
    rows = read_metrics(logger.jsonl_path)
    assert {r["global_step"] for r in rows} == {7} and all("queue/pending_s" in r for r in rows)
    assert core.get("done")["step"] == 1 and core.get("done")["last_checkpoint"] == "/ckpt/done/final"


def test_a_step_without_endings_is_one_call_and_one_without_results_logs_nothing(tmp_path: Path) -> None:
    core = ControllerCore(num_slots=1, max_rank=16)
    core.register({**_spec("a"), "num_steps": 5})
    snapshot_id = core.snapshot().snapshot_id
    logger = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False, plot=False), tmp_path)
    calls = []

    def apply(part: StepReport) -> dict[str, dict[str, float]]:
        calls.append(part)
        return core.apply_report(part)

    step = StepReport(
        snapshot_id, {"a": AdapterResult(trained=True, step=1, metrics={"step": 1})}, {}, {}, {}, (), {}
    )
    assert apply_and_log(apply, logger, step, 0, lambda: (1, 5)) and len(calls) == 1
    idle = StepReport(snapshot_id, {}, {}, {}, {}, (), {})
    assert not apply_and_log(apply, logger, idle, 1, lambda: (1, 5)) and len(calls) == 2
    assert [r["step"] for r in read_metrics(logger.jsonl_path)] == [1]
