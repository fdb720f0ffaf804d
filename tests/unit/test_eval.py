"""Held-out evaluation without a model: the spec's eval section, the held-out sets (never a
training item), pass@k and the summary metrics, the controller's last_eval, the console and plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.table import Table
from rich.text import Text

from miles_multilora.config.adapter import eval_pool_size, eval_seed, parse_adapter_spec
from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.admission import AdmissionRules
from miles_multilora.controller.snapshot import AdapterResult
from miles_multilora.data.datasets import load_adapter_dataset
from miles_multilora.data.evaluation import build_held_out, eval_metrics, standard_error
from miles_multilora.data.validation import validate_adapter_resources
from miles_multilora.errors import SpecError
from miles_multilora.launch.metrics import (
    MetricsLogger,
    draw_panel,
    draw_wall_clock_panel,
    eval_points,
    plot_panels,
    plot_rewards,
    reward_series,
    wall_clock_key,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_ADAPTERS = sorted((REPO_ROOT / "examples" / "multi_lora" / "adapters").glob("*.yaml"))


def gym(eval_section: dict[str, Any] | None = None, **dataset: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "a",
        "dataset": {"task": "basic_arithmetic", "size": 50, "seed": 7, **dataset},
        "num_steps": 2,
    }
    if eval_section is not None:
        spec["eval"] = eval_section
    return spec


def hf(path: str, eval_section: dict[str, Any], **dataset: Any) -> dict[str, Any]:
    return {"name": "h", "dataset": {"path": path, **dataset}, "num_steps": 2, "eval": eval_section}


def write_jsonl(path: Path, questions: list[str]) -> str:
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    return str(path)


# ----------------------------------------------------------------------------- the spec
@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"size": 0}, "eval.size"),
        ({"size": 5000}, "eval.size"),
        ({"every": -1}, "eval.every"),
        ({"samples": 0}, "eval.samples"),
        ({"samples": 1024, "size": 100}, "eval.samples"),
        ({"seed": 7}, "eval.seed"),  # the training seeds are 7..56
        ({"seed": 7 - eval_pool_size(32) + 1}, "eval.seed"),  # its pool would reach seed 7
        ({"path": "x.jsonl"}, "eval.path"),  # HF keys on a reasoning-gym dataset
        ({"split": "test"}, "eval.split"),
        ({"size": "many"}, "eval.size"),
        ({"unknown": 1}, "eval.unknown"),
    ],
)
def test_invalid_eval_sections_name_the_key(section: dict[str, Any], key: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(gym(section))
    assert info.value.key == key


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({}, "eval.split"),  # nothing held out named
        ({"split": "train"}, "eval.split"),  # the training split itself
        ({"path": "d.jsonl"}, "eval.path"),  # the training file itself
        ({"path": "e.jsonl", "seed": 3}, "eval.seed"),  # seed is for reasoning-gym
    ],
)
def test_invalid_hf_eval_sections_name_the_key(section: dict[str, Any], key: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(hf("d.jsonl", section))
    assert info.value.key == key


def test_specs_without_eval_are_unchanged_and_eval_round_trips() -> None:
    plain = parse_adapter_spec(gym())
    assert plain.eval is None and "eval" not in plain.to_dict()
    spec = parse_adapter_spec(gym({"size": 8, "every": 3, "samples": 4}))
    assert spec.eval is not None and (spec.eval.size, spec.eval.every, spec.eval.samples) == (8, 3, 4)
    assert parse_adapter_spec(spec.to_dict()) == spec
    assert eval_seed(spec) == 7 + 50  # just past the training seeds


# ----------------------------------------------------------------------------- held-out sets
@pytest.mark.parametrize("path", DEMO_ADAPTERS, ids=lambda p: p.stem)
def test_reasoning_gym_eval_items_are_never_training_items(path: Path) -> None:
    spec = parse_adapter_spec(path)
    assert spec.eval is not None, "the demo adapters evaluate on held-out items"
    ds = spec.dataset
    # by construction: the eval generator's seeds lie past every training seed ...
    assert eval_seed(spec) >= ds.seed + ds.size
    train = load_adapter_dataset(ds)
    held_out = build_held_out(spec, train)
    # ... and an item repeating a training question (small tasks repeat) is skipped: check them all
    training = set(train.questions())
    questions = [item.question for item in held_out.items]
    assert len(questions) == spec.eval.size == len(set(questions))
    assert not training & set(questions)
    assert all(
        item.answer is not None and item.uid.startswith(f"{spec.name}:eval:") for item in held_out.items
    )
    # deterministic: the same set on every rank and every start
    assert [i.question for i in build_held_out(spec, train).items] == questions


def test_small_task_spaces_need_the_skip_and_refuse_a_too_large_eval() -> None:
    one_digit = parse_adapter_spec(
        REPO_ROOT / "examples/multi_lora/adapters/arithmetic.yaml"
    ).dataset.task_params
    spec = parse_adapter_spec(gym({"size": 4}, size=500, seed=1, task_params=one_digit))
    train = load_adapter_dataset(spec.dataset)
    held_out = build_held_out(spec, train)
    assert held_out.skipped > 0  # distinct seeds alone would have repeated training questions
    too_many = parse_adapter_spec(gym({"size": 40}, size=500, seed=1, task_params=one_digit))
    with pytest.raises(SpecError) as info:
        build_held_out(too_many, train)
    assert info.value.key == "eval.size"


def test_hf_eval_rows_skip_training_questions_and_bad_data_names_the_key(tmp_path: Path) -> None:
    train_path = write_jsonl(tmp_path / "train.jsonl", ["q1", "q2", "q3"])
    eval_path = write_jsonl(tmp_path / "eval.jsonl", ["q2", "e1", "e1", "e2"])
    spec = parse_adapter_spec(hf(train_path, {"path": eval_path, "size": 10}))
    held_out = build_held_out(spec, load_adapter_dataset(spec.dataset))
    assert [i.question for i in held_out.items] == ["e1", "e2"] and held_out.skipped == 2
    validate_adapter_resources(spec)
    for section, key in (
        ({"split": "test"}, "eval.path"),  # a single file has no splits
        ({"path": str(tmp_path / "missing.jsonl")}, "eval.path"),
        ({"path": eval_path, "prompt_key": "nope"}, "eval.prompt_key"),
    ):
        bad = parse_adapter_spec(hf(train_path, section))
        with pytest.raises(SpecError) as info:
            validate_adapter_resources(bad)
        assert info.value.key == key


def test_network_specs_read_eval_files_only_under_the_dataset_roots(tmp_path: Path) -> None:
    rules = AdmissionRules(dataset_roots=(str(tmp_path / "data"),))
    inside = str(tmp_path / "data" / "d.jsonl")
    rules.check(parse_adapter_spec(hf(inside, {"path": str(tmp_path / "data" / "e.jsonl")})), remote=True)
    with pytest.raises(SpecError) as info:
        rules.check(parse_adapter_spec(hf(inside, {"path": "/etc/passwd.jsonl"})), remote=True)
    assert info.value.key == "eval.path"


# ----------------------------------------------------------------------------- metrics
def test_pass_at_k_and_eval_metrics_on_a_hand_made_case() -> None:
    correct = [[False, True, False], [False, False, False], [True, True, True], [None, True, False]]
    rewards = [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 1.0, 0.0]]
    pass_at_3 = eval_metrics(rewards, correct, k=3)["eval/pass@3"]
    assert pass_at_3 == pytest.approx(2 / 3)  # the unknown item is left out
    assert "eval/pass@2" not in eval_metrics([[0.0, 1.0]] * 2, [[None, None]] * 2, k=2)  # none known
    m = eval_metrics(rewards, correct, k=3)
    assert m["eval/size"] == 4
    assert m["eval/reward_mean"] == pytest.approx(5.5 / 12)
    assert m["eval/accuracy"] == pytest.approx(5 / 11)
    assert m["eval/pass@3"] == pytest.approx(2 / 3)
    greedy = eval_metrics([[1.0], [0.0]], [[None], [None]], k=1)
    # no accuracy, no pass@k; the SE of rewards 1 and 0: their standard deviation 0.707 / sqrt(2)
    assert greedy == {"eval/size": 2, "eval/reward_mean": 0.5, "eval/reward_mean_se": pytest.approx(0.5)}


def _numpy_se(values: list[float]) -> float:
    return float(np.std(values, ddof=1) / np.sqrt(len(values)))


def test_standard_errors_are_over_items_not_samples() -> None:
    rng = np.random.default_rng(0)
    correct = (rng.random((40, 4)) < np.linspace(0.1, 0.9, 40)[:, None]).tolist()
    rewards = [[float(c) + 0.25 * (j % 2) for j, c in enumerate(item)] for item in correct]
    m = eval_metrics(rewards, correct, k=4)
    item_rewards = [float(np.mean(r)) for r in rewards]
    item_accuracy = [float(np.mean(c)) for c in correct]
    assert m["eval/reward_mean_se"] == pytest.approx(_numpy_se(item_rewards))
    assert m["eval/accuracy_se"] == pytest.approx(_numpy_se(item_accuracy))
    assert m["eval/pass@4_se"] == pytest.approx(_numpy_se([float(any(c)) for c in correct]))
    # the items' k samples are not independent draws: a per-sample SE would be smaller here
    assert m["eval/accuracy_se"] > _numpy_se([float(c) for item in correct for c in item])
    # greedy (k = 1): the binomial SE sqrt(p (1 - p) / (n - 1)) of n items
    greedy = eval_metrics([[1.0], [0.0], [1.0], [1.0]], [[True], [False], [True], [True]], k=1)
    assert greedy["eval/accuracy_se"] == pytest.approx(np.sqrt(0.75 * 0.25 / 3))
    assert standard_error([0.5]) is None and standard_error([]) is None
    assert not any(k.endswith("_se") for k in eval_metrics([[1.0, 0.0]], [[True, False]], k=2))


def test_the_controller_record_keeps_the_last_eval(tmp_path: Path) -> None:
    core = ControllerCore(num_slots=2, max_rank=16, state_dir=tmp_path)
    core.register(gym({"every": 2}))
    core.register({**gym(), "name": "b"})
    core.snapshot()
    core.report_step(
        {"a": AdapterResult(trained=True, metrics={"reward_mean": 0.1}), "b": AdapterResult(trained=True)}
    )
    assert core.get("a")["last_eval"] is None
    evaluated = {"reward_mean": 0.2, "eval/reward_mean": 0.4, "eval/accuracy": 0.5, "eval/size": 32}
    core.report_step({"a": AdapterResult(trained=True, metrics=evaluated), "b": AdapterResult(trained=True)})
    core.report_step(
        {"a": AdapterResult(trained=True, metrics={"reward_mean": 0.3}), "b": AdapterResult(trained=True)}
    )
    last = core.get("a")["last_eval"]
    assert {k: v for k, v in last.items() if k != "time"} == {
        "step": 2,
        "reward_mean": 0.4,
        "accuracy": 0.5,
        "size": 32,
    }
    assert core.get("b")["last_eval"] is None
    json.dumps(core.list())
    restored = ControllerCore.restore(tmp_path, num_slots=2, max_rank=16)
    assert restored.get("a")["last_eval"] == last
    core.mark_done("a", "/ck/a")
    assert core.get("a")["last_eval"] == last  # the finished run's history entry keeps it


def test_console_prints_an_eval_table_only_in_steps_with_an_eval(tmp_path: Path) -> None:
    logger = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False), tmp_path)
    assert logger._eval_table({"a": {"step": 1, "reward_mean": 0.5}}) is None
    evaluated = {"step": 2, "eval/reward_mean": 0.25, "eval/accuracy": 0.5, "eval/size": 16}
    table = logger._eval_table({"a": evaluated, "b": {"step": 2, "reward_mean": 0.1}})
    assert table is not None
    assert [c.header for c in table.columns] == ["adapter", "step", "accuracy", "reward_mean", "size"]
    assert [list(c.cells) for c in table.columns] == [["a"], ["2"], ["0.5"], ["0.25"], ["16"]]
    with_se = {**evaluated, "eval/accuracy_se": 0.129, "eval/reward_mean_se": 0.0625}
    table = logger._eval_table({"a": with_se})
    assert table is not None
    assert [c.header for c in table.columns] == ["adapter", "step", "accuracy", "reward_mean", "size"]
    assert [list(c.cells) for c in table.columns][2:] == [["0.5 ± 0.13"], ["0.25 ± 0.062"], ["16"]]


def test_the_step_table_leaves_out_adapters_that_only_had_their_step_0_eval(tmp_path: Path) -> None:
    logger = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False), tmp_path)
    step0 = {"step": 0, "version": 0, "eval/accuracy": 0.0, "eval/size": 64, "tokens_per_s": 0.0}
    trained = {"step": 1, "reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 9.0}
    table = logger._table(3, {"new": step0, "old": trained}, {"step_s": 2.0})
    assert isinstance(table, Table) and list(table.columns[0].cells) == ["old"]
    only_evals = logger._table(0, {"new": step0}, {"eval_s": 4.0, "step_s": 4.0})
    assert isinstance(only_evals, Text) and only_evals.plain.startswith("step 0   eval=4.0s")
    evals = logger._eval_table({"new": step0, "old": trained})
    assert evals is not None and list(evals.columns[0].cells) == ["new"]


def test_the_reward_plot_draws_the_eval_curve(tmp_path: Path) -> None:
    rows = [
        {
            "adapter": "a",
            "step": s,
            "reward_mean": 0.1 * s,
            **({"eval/reward_mean": 0.05 * s} if s % 2 == 0 else {}),
        }
        for s in (1, 2, 3, 4)
    ] + [{"adapter": "b", "step": 1, "reward_mean": 0.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held_out = reward_series(rows)
    assert train["a"] == [(1, 0.1), (2, 0.2), (3, 0.30000000000000004), (4, 0.4)]
    assert held_out == {"a": [(2, 0.1), (4, 0.2)]}
    png = plot_rewards(path, tmp_path / "rewards.png")
    assert png is not None and png.stat().st_size > 0


@pytest.mark.parametrize("key", ["reward_mean", "accuracy"])
def test_the_plot_draws_a_standard_error_band_and_bars_around_the_eval_curve(key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    evals = {0: (0.2, 0.05), 4: (0.5, 0.08), 8: (0.6, 0.04)}
    rows = [{"adapter": "a", "step": s, f"eval/{key}": m, f"eval/{key}_se": e} for s, (m, e) in evals.items()]
    rows += [{"adapter": "a", "step": s, key: 0.1 * s} for s in range(1, 9)]
    rows += [{"adapter": "b", "step": 0, f"eval/{key}": 0.3}]  # an eval without its SE: no band
    points = eval_points(rows, f"eval/{key}")
    assert points["a"][0] == (0, 0.2, 0.05) and points["b"] == [(0, 0.3, None)]
    assert [k for k, _ in plot_panels(rows)] == [key]  # a panel only for the metric logged
    fig, ax = plt.subplots()
    try:
        assert draw_panel(ax, rows, key, key)
        bands = [
            c for c in ax.collections if type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection")
        ]
        assert len(bands) == 1  # adapter a only
        vertices = bands[0].get_paths()[0].vertices
        for step, (mean, se) in evals.items():
            ys = vertices[np.isclose(vertices[:, 0], step), 1]
            assert min(ys) == pytest.approx(mean - se) and max(ys) == pytest.approx(mean + se)
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == 2
        segments = bars[0].lines[2][0].get_segments()  # adapter a's vertical error bars
        assert [tuple(np.round(seg[:, 1], 6)) for seg in segments] == [
            (round(m - e, 6), round(m + e, 6)) for m, e in evals.values()
        ]
        assert "held-out eval ± SE" in " ".join(t.get_text() for t in ax.get_legend().get_texts())
        assert not draw_panel(ax, rows, "kl", "kl")  # nothing logged: nothing drawn
    finally:
        plt.close(fig)


def test_the_plot_has_an_accuracy_panel_beside_the_reward_when_the_reward_knows_correctness(
    tmp_path: Path,
) -> None:
    import matplotlib.image

    rows = [{"adapter": "a", "step": s, "reward_mean": 0.3 * s, "accuracy": 0.2 * s} for s in (1, 2)]
    rows += [{"adapter": "a", "step": 0, "eval/reward_mean": 0.1, "eval/accuracy": 0.0}]
    assert [k for k, _ in plot_panels(rows)] == ["reward_mean", "accuracy"]
    path = tmp_path / "metrics.jsonl"
    widths = []
    for lines in (rows, [{k: v for k, v in r.items() if "accuracy" not in k} for r in rows]):
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        png = plot_rewards(path, tmp_path / "rewards.png")
        assert png is not None
        widths.append(matplotlib.image.imread(png).shape[1])
    assert widths[0] == 2 * widths[1]  # two panels side by side, then one


def test_held_out_accuracy_is_drawn_against_wall_clock_seconds(tmp_path: Path) -> None:
    """Rows carry the run's wall-clock seconds: the plot gets a panel of held-out accuracy against
    them (preferred over the reward when the reward reports accuracy), at each eval's time."""
    rows = [
        {"adapter": "a", "step": 0, "wall_s": 3.0, "eval/accuracy": 0.2, "eval/reward_mean": 0.1},
        {"adapter": "a", "step": 1, "wall_s": 9.5, "accuracy": 0.4},
        {"adapter": "a", "step": 2, "wall_s": 20.0, "eval/accuracy": 0.7, "eval/accuracy_se": 0.1},
    ]
    assert wall_clock_key(rows) == "accuracy"
    assert eval_points(rows, "eval/accuracy", x="wall_s")["a"] == [(3.0, 0.2, None), (20.0, 0.7, 0.1)]
    assert wall_clock_key([{k: v for k, v in r.items() if k != "wall_s"} for r in rows]) is None
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        draw_wall_clock_panel(ax, rows, "accuracy", {"a": "C0"})
        assert "wall-clock" in ax.get_xlabel()
        (line,) = ax.get_lines()[:1]
        assert list(line.get_xdata()) == [3.0, 20.0]
    finally:
        plt.close(fig)
    assert plot_rewards(path, tmp_path / "rewards.png") is not None


def test_each_logged_row_carries_the_wall_clock(tmp_path: Path) -> None:
    from miles_multilora.launch.metrics import read_metrics

    logger = MetricsLogger(LoggingConfig(wandb_mode="disabled", console=False), tmp_path)
    logger.log_step(0, {"a": {"step": 1, "reward_mean": 0.5}}, {"step_s": 1.0})
    time.sleep(0.05)
    logger.log_step(1, {"a": {"step": 2, "reward_mean": 0.6}}, {"step_s": 1.0})
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert 0 <= first["wall_s"] < second["wall_s"]
