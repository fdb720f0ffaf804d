"""Per-adapter metrics: wandb (offline by default), a JSONL file, a rich console table, a reward plot.

Every metric is namespaced by adapter name (``<adapter>/reward_mean``) in wandb; the JSONL file
holds one line per (step, adapter). Held-out eval metrics (``eval/*``) appear in the steps where
the adapter was evaluated; the plot draws them as a dashed curve next to the training reward, with a
band of +/- one standard error (``eval/reward_mean_se``), and the console shows each as mean +/- SE.
The controller adds each adapter's queue time (``queue/pending_s``, ``queue/parked_s``) to its row.
Every file written is readable by its owner only (:mod:`miles_multilora.private_files`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table
from rich.text import Text

from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.data.evaluation import SE_SUFFIX
from miles_multilora.private_files import make_private, private_dir, private_open

CONSOLE_COLUMNS = (
    "step",
    "reward_mean",
    "accuracy",
    "response_len",
    "clip_frac",
    "kl",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "logprob_diff_mean",
    "logprob_diff_max",
    "kl_sample_train_v1",
)
# short headers for long metric names (the sampler-trainer drift: docs/design.md)
CONSOLE_HEADERS = {
    "logprob_diff_mean": "|dlp| mean",
    "logprob_diff_max": "|dlp| max",
    "kl_sample_train_v1": "kl s-t",
}
EVAL_PREFIX = "eval/"


def metrics_path(output_dir: str | Path) -> Path:
    """The run's JSONL metrics file."""
    return Path(output_dir) / "metrics.jsonl"


def make_console() -> Console:
    """A rich console; 120 columns when writing to a file or CI log instead of a terminal."""
    return Console(width=None if sys.stdout.isatty() else 120)


class MetricsLogger:
    def __init__(
        self,
        cfg: LoggingConfig,
        output_dir: str | Path,
        run_name: str = "run",
        console: Console | None = None,
    ) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        private_dir(self.output_dir)
        self.console = console or make_console()
        self.jsonl_path = metrics_path(self.output_dir)
        self._started = time.monotonic()  # each row's wall_s: seconds since this logger started
        self._wandb = None
        if cfg.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            private_dir(self.output_dir / "wandb")  # wandb's own files are 0644: in a 0700 directory
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                name=run_name,
                mode=cfg.wandb_mode,
                dir=str(self.output_dir),
                reinit="finish_previous",
            )

    def log_step(
        self,
        global_step: int,
        per_adapter: dict[str, dict[str, Any]],
        step_info: dict[str, float],
        progress: tuple[int, int] | None = None,
    ) -> None:
        if self.cfg.jsonl:
            with private_open(self.jsonl_path, "a") as fh:
                for adapter, metrics in per_adapter.items():
                    fh.write(
                        json.dumps(
                            {
                                "global_step": global_step,
                                "adapter": adapter,
                                "wall_s": round(time.monotonic() - self._started, 3),
                                **metrics,
                                **{f"step/{k}": v for k, v in step_info.items()},
                            }
                        )
                        + "\n"
                    )
        if self._wandb is not None:
            flat = {
                f"{a}/{k}": v
                for a, m in per_adapter.items()
                for k, v in m.items()
                if isinstance(v, int | float)
            }
            flat.update({f"step/{k}": v for k, v in step_info.items()})
            self._wandb.log(flat, step=global_step)
        if self.cfg.console and per_adapter:
            self.console.print(self._table(global_step, per_adapter, step_info))
            evaluated = self._eval_table(per_adapter)
            if evaluated is not None:
                self.console.print(evaluated)
            if progress and progress[1]:
                from rich.progress_bar import ProgressBar

                done, total = progress
                bar = Table.grid(padding=(0, 1))
                bar.add_row(
                    ProgressBar(total=total, completed=done, width=40), f"{done}/{total} adapter steps"
                )
                self.console.print(bar)

    def _table(
        self, global_step: int, per_adapter: dict[str, dict[str, Any]], step_info: dict[str, float]
    ) -> Table | Text:
        """The step's training metrics, one row per adapter that trained (or tried to)."""
        timing = "  ".join(
            f"{k.removesuffix('_s')}={v:.1f}s"
            for k, v in step_info.items()
            if k.endswith("_s") and k != "tokens_per_s"
        )
        if "tokens_per_s" in step_info:
            timing += f"  tokens/s={step_info['tokens_per_s']:.1f}"
        title = f"step {global_step}   {timing}"
        trained = {a: m for a, m in per_adapter.items() if not _eval_only(m)}
        if not trained:  # every adapter only had its step-0 eval: the eval table follows
            return Text(title)
        table = Table(title=title, title_justify="left")
        table.add_column("adapter", no_wrap=True)
        for col in CONSOLE_COLUMNS:
            table.add_column(CONSOLE_HEADERS.get(col, col), justify="right")
        for adapter, m in trained.items():
            table.add_row(adapter, *(_fmt(m.get(col)) for col in CONSOLE_COLUMNS))
        return table

    @staticmethod
    def _eval_table(per_adapter: dict[str, dict[str, Any]]) -> Table | None:
        """The held-out eval of the adapters evaluated this step (``eval/*`` metrics), or None."""
        evaluated = {a: m for a, m in per_adapter.items() if any(k.startswith(EVAL_PREFIX) for k in m)}
        if not evaluated:
            return None
        found = {k for m in evaluated.values() for k in m if k.startswith(EVAL_PREFIX)}
        keys = sorted(k for k in found if not k.endswith(SE_SUFFIX))  # an SE is shown beside its mean
        keys = [k for k in keys if k != "eval/error"] + (["eval/error"] if "eval/error" in keys else [])
        table = Table(title="held-out eval (mean ± standard error over items)", title_justify="left")
        for col in ("adapter", "step", *(k.removeprefix(EVAL_PREFIX) for k in keys)):
            table.add_column(col, justify="left" if col in ("adapter", "error") else "right")
        for adapter, m in evaluated.items():
            cells = (_fmt_mean(m.get(k), m.get(k + SE_SUFFIX)) for k in keys)
            table.add_row(adapter, _fmt(m.get("step")), *cells)
        return table

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
            make_private(self.output_dir / "wandb")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def _eval_only(metrics: dict[str, Any]) -> bool:
    """True for an adapter's step-0 row: held-out metrics and no training column besides the step."""
    training = {c for c in CONSOLE_COLUMNS if c not in ("step", "tokens_per_s") and c in metrics}
    return not training and any(k.startswith(EVAL_PREFIX) for k in metrics)


def _fmt_mean(value: Any, se: Any) -> str:
    """``value`` with its standard error (``0.625 ± 0.121``) when it has one."""
    if isinstance(se, int | float) and math.isfinite(se):
        return f"{_fmt(value)} ± {se:.2g}"
    return _fmt(value)


def next_global_step(jsonl_path: str | Path) -> int:
    """The global step after the last one logged in ``jsonl_path`` (0 for a new run)."""
    rows = read_metrics(jsonl_path)
    return max((int(r.get("global_step", -1)) for r in rows), default=-1) + 1


def read_metrics(jsonl_path: str | Path) -> list[dict[str, Any]]:
    path = Path(jsonl_path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


Series = dict[str, list[tuple[int, float]]]
# The plot's panels: a metric of the training samples and its held-out counterpart ``eval/<metric>``.
PANELS = (("reward_mean", "mean reward"), ("accuracy", "accuracy"))


class EvalPoint(NamedTuple):
    """One held-out eval of an adapter: its step (or wall-clock second), the eval mean and that
    mean's standard error."""

    step: float
    mean: float
    se: float | None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def train_series(rows: list[dict[str, Any]], key: str = "reward_mean") -> Series:
    """Per adapter, (step, value) points of training metric ``key``, sorted by step."""
    out: Series = {}
    for row in rows:
        value = row.get(key)
        if _finite(value):
            out.setdefault(row["adapter"], []).append((int(row["step"]), float(value)))
    for points in out.values():
        points.sort()
    return out


def eval_points(
    rows: list[dict[str, Any]], key: str = "eval/reward_mean", x: str = "step"
) -> dict[str, list[EvalPoint]]:
    """Per adapter, its held-out evals of ``key`` sorted by step (SE None where the row has none);
    ``x="wall_s"``: placed at the run's wall-clock seconds instead (rows without them are left out)."""
    out: dict[str, list[EvalPoint]] = {}
    for row in rows:
        value, se = row.get(key), row.get(key + SE_SUFFIX)
        at = row.get("eval/step", row.get("step")) if x == "step" else row.get(x)  # a late eval: its own step
        if _finite(value) and _finite(at):
            point = EvalPoint(at, float(value), float(se) if _finite(se) else None)
            out.setdefault(row["adapter"], []).append(point)
    for points in out.values():
        points.sort(key=lambda p: p.step)
    return out


def reward_series(rows: list[dict[str, Any]]) -> tuple[Series, Series]:
    """Per adapter, (step, value) points sorted by step: training ``reward_mean`` and held-out
    ``eval/reward_mean``."""
    held_out = {a: [(p.step, p.mean) for p in points] for a, points in eval_points(rows).items()}
    return train_series(rows), held_out


def plot_panels(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (metric, label) panels of :data:`PANELS` that ``rows`` have data for."""
    return [
        (key, label)
        for key, label in PANELS
        if train_series(rows, key) or eval_points(rows, EVAL_PREFIX + key)
    ]


def plot_rewards(jsonl_path: str | Path, out_png: str | Path) -> Path | None:
    """A PNG with a panel per metric of :data:`PANELS` that the run logged (the reward; the
    accuracy when a reward reports correctness): each adapter's training curve against its own
    step and, for adapters with an eval section, its held-out curve (dashed, same colour) with
    error bars and a band of +/- one standard error over the eval items."""
    rows = read_metrics(jsonl_path)
    panels = plot_panels(rows)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adapters = sorted({r["adapter"] for r in rows if "adapter" in r})
    timed = wall_clock_key(rows)
    fig, axes = plt.subplots(
        1, len(panels) + bool(timed), figsize=(7 * (len(panels) + bool(timed)), 4.6), squeeze=False
    )
    colors = {a: f"C{i % 10}" for i, a in enumerate(adapters)}
    for ax, (key, label) in zip(axes[0], panels, strict=False):
        draw_panel(ax, rows, key, label, colors, legend=False)
    if timed:
        draw_wall_clock_panel(axes[0][-1], rows, timed, colors)
    handles, labels = axes[0][0].get_legend_handles_labels()  # one legend for all panels, below them
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(adapters)), fontsize="small")
    rows_of_legend = -(-len(labels) // max(1, len(adapters)))
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend, 1, 1))
    out_png = Path(out_png)
    with private_open(out_png, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)
    return out_png


def draw_panel(
    ax: Any,
    rows: list[dict[str, Any]],
    key: str,
    label: str,
    colors: dict[str, str] | None = None,
    legend: bool = True,
) -> bool:
    """Draw training metric ``key`` (solid) and held-out ``eval/<key>`` (dashed, +/- SE) of every
    adapter in ``rows`` on matplotlib axes ``ax`` (with its own legend unless ``legend`` is False);
    False when there is nothing to draw."""
    series, held_out = train_series(rows, key), eval_points(rows, EVAL_PREFIX + key)
    adapters = sorted(set(series) | set(held_out))
    if not adapters:
        return False
    colors = colors or {a: f"C{i % 10}" for i, a in enumerate(adapters)}
    for adapter in adapters:
        color = colors.get(adapter, "C0")
        points = series.get(adapter, [])
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color, marker="o", label=adapter)
        if held_out.get(adapter):
            _plot_held_out(ax, held_out[adapter], color, f"{adapter} (held-out eval ± SE)")
    ax.set_xlabel("adapter step")
    ax.set_ylabel(label)
    title = f"{label} per adapter" + (
        " (solid: training samples, dashed: held-out eval ± 1 SE)" if held_out else ""
    )
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="small")
    return True


def wall_clock_key(rows: list[dict[str, Any]]) -> str | None:
    """The held-out metric to draw against wall-clock seconds (accuracy where the reward reports it,
    else the reward), or None when no held-out eval row carries ``wall_s``."""
    for key in ("accuracy", "reward_mean"):
        if eval_points(rows, EVAL_PREFIX + key, x="wall_s"):
            return key
    return None


def draw_wall_clock_panel(ax: Any, rows: list[dict[str, Any]], key: str, colors: dict[str, str]) -> None:
    """Each adapter's held-out ``eval/<key>`` (± SE) against the run's wall-clock seconds."""
    for adapter, points in sorted(eval_points(rows, EVAL_PREFIX + key, x="wall_s").items()):
        _plot_held_out(ax, points, colors.get(adapter, "C0"), f"{adapter} (held-out eval ± SE)")
    ax.set_xlabel("wall-clock seconds since the run started")
    ax.set_ylabel(f"held-out {key.replace('_', ' ')}")
    ax.set_title(f"held-out {key.replace('_', ' ')} against wall-clock (± 1 SE)", fontsize="medium")
    ax.grid(alpha=0.3)


def _plot_held_out(ax: Any, points: list[EvalPoint], color: str, label: str) -> None:
    """A dashed held-out curve; where the points have standard errors, error bars and a band."""
    xs, ys = [p.step for p in points], [p.mean for p in points]
    errors = [p.se or 0.0 for p in points]
    ax.errorbar(xs, ys, yerr=errors, color=color, linestyle="--", marker="s", capsize=3, label=label)
    if any(p.se is not None for p in points):
        low = [y - e for y, e in zip(ys, errors, strict=True)]
        high = [y + e for y, e in zip(ys, errors, strict=True)]
        ax.fill_between(xs, low, high, color=color, alpha=0.15, linewidth=0)
