"""Per-step time breakdown of a real training run (default: configs/train.yaml, the demo model).

Runs ``run_training`` on the composed config (hydra ``key=value`` overrides accepted), then reads the
run's ``metrics.jsonl`` and prints the mean time of each phase of a training step (generate+reward,
train, sync, checkpoint, setup, total) and the generated tokens/s, leaving out the first
``--warmup`` steps (model warm-up). ``--metrics`` only summarises an existing ``metrics.jsonl``.

    python benchmarks/step_time.py trainer.max_steps=3
    python benchmarks/step_time.py model=tiny lora.num_slots=8 --warmup 2
    python benchmarks/step_time.py --metrics runs/demo/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PHASES = (
    ("generate + reward", "step/generate_reward_s"),
    ("train", "step/train_s"),
    ("sync", "step/sync_s"),
    ("checkpoint", "step/checkpoint_s"),
    ("held-out eval (steps with one)", "step/eval_s"),
    ("setup (slots, init)", "step/setup_s"),
    ("total", "step/step_s"),
)
TOKENS_PER_S = "step/tokens_per_s"


def step_timings(metrics_path: Path) -> list[dict[str, float]]:
    """One dict of ``step/*`` timings per global training step (the JSONL has a line per adapter)."""
    steps: list[dict[str, float]] = []
    previous: tuple[Any, ...] | None = None
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        timing = {k: float(v) for k, v in row.items() if k.startswith("step/")}
        key = (row.get("global_step"), timing.get("step/step_s"))
        if timing and key != previous:  # a new step (the adapters of one step share its timings)
            steps.append(timing)
        previous = key
    return steps


def timing_table(steps: list[dict[str, float]], warmup: int) -> Table:
    """Mean / min / max seconds per phase over ``steps[warmup:]`` and its share of the total."""
    kept = steps[warmup:] if len(steps) > warmup else steps
    total = statistics.fmean(s.get("step/step_s", 0.0) for s in kept)
    table = Table(title=f"step time over {len(kept)} steps (first {len(steps) - len(kept)} left out)")
    for column in ("phase", "mean s", "min s", "max s", "share"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for label, key in PHASES:
        values = [s.get(key, 0.0) for s in kept]
        mean = statistics.fmean(values)
        share = f"{100 * mean / total:.0f}%" if total > 0 else "-"
        table.add_row(label, f"{mean:.3f}", f"{min(values):.3f}", f"{max(values):.3f}", share)
    rates = [s.get(TOKENS_PER_S, 0.0) for s in kept]
    table.add_row(
        "tokens/s (generated)", f"{statistics.fmean(rates):.1f}", f"{min(rates):.1f}", f"{max(rates):.1f}", ""
    )
    return table


def run(overrides: list[str], console: Console) -> Path:
    """Train with ``configs/train.yaml`` + ``overrides``; returns the run's metrics.jsonl."""
    from miles_multilora.config.run import load_run_config
    from miles_multilora.launch.run import run_training

    if not any(o.startswith("trainer.output_dir=") for o in overrides):
        overrides = [*overrides, f"trainer.output_dir={tempfile.mkdtemp(prefix='step_time_')}"]
    cfg = load_run_config("train", overrides)
    run_training(cfg, console=console)
    return Path(cfg.trainer.output_dir) / "metrics.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. trainer.max_steps=3 model=tiny")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps left out of the means")
    parser.add_argument("--metrics", type=Path, default=None, help="summarise this metrics.jsonl, no run")
    args = parser.parse_args(argv)
    console = Console()
    metrics = args.metrics or run(args.overrides, console)
    steps = step_timings(metrics)
    if not steps:
        console.print(f"[red]no step timings in {metrics}[/red]")
        return 1
    console.print(timing_table(steps, args.warmup))
    console.print(f"metrics: {metrics}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
