"""The table, plot and merge of ``benchmarks/vs_trl.py``: held-out curves of ours and of the peer
(TRL), per adapter, against wall-clock seconds.

A result is a JSON-able dict::

    {"settings": {...}, "device": "...", "commands": [...],
     "ours": {"run_s": ..., "load_s": ..., "adapters": {name: {"task": ..., "points": [...]}}},
     "peer": {"adapters": {name: {"task": ..., "points": [...], "train_s": ..., "load_s": ...}}}}

A point is ``{"step", "t", "acc", "se", "size"}``: held-out accuracy (mean over the eval items, and
its standard error) after ``step`` optimizer steps, ``t`` wall-clock seconds since training started
(after the model load; held-out eval time left out), the same clock for both.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EPS = 1e-9  # accuracies are shares of items: "reached" tolerates float noise only


def reach_point(points: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first eval (in step order) whose accuracy is >= ``target``; None when none is."""
    for p in sorted(points, key=lambda p: (p["step"], p["t"])):
        if p["acc"] >= target - EPS:
            return p
    return None


def reach_time(points: list[dict[str, Any]], target: float) -> float | None:
    """The time of :func:`reach_point`."""
    p = reach_point(points, target)
    return None if p is None else float(p["t"])


def final_point(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The eval at the last step (None without evals)."""
    return max(points, key=lambda p: (p["step"], p["t"])) if points else None


@dataclass
class Row:
    """One adapter's line of the table (ours is None where ours did not run it)."""

    name: str
    task: str
    peer_final: dict[str, Any]
    peer_s: float
    ours_final: dict[str, Any] | None
    ours_reach: dict[str, Any] | None  # ours' first eval at or above the peer's final accuracy

    @property
    def ours_reach_s(self) -> float | None:
        return None if self.ours_reach is None else float(self.ours_reach["t"])

    @property
    def at_start(self) -> bool:
        """Ours was there before training (the peer ended no better than the base model)."""
        return self.ours_reach is not None and self.ours_reach["step"] == 0

    @property
    def speedup(self) -> float | None:
        if self.ours_reach_s is None:
            return None
        return self.peer_s / max(self.ours_reach_s, EPS)


@dataclass
class Totals:
    """The K adapters the peer ran, one after another, against ours training them together."""

    adapters: int  # K: adapters the peer ran
    ours_adapters: int  # N: adapters ours trained at once
    peer_s: float  # the sum of the peer's K training times
    ours_reach_s: float | None  # ours until every one of the K reached the peer's final accuracy
    ours_run_s: float | None  # ours' whole run (all N adapters to their last step)

    @property
    def speedup_reach(self) -> float | None:
        return None if self.ours_reach_s is None else self.peer_s / max(self.ours_reach_s, EPS)

    @property
    def peer_all_s(self) -> float:
        """The peer's time for all N adapters, estimated from its mean over the K it ran."""
        return self.peer_s / max(self.adapters, 1) * self.ours_adapters


def table_rows(result: dict[str, Any]) -> list[Row]:
    """A row per adapter the peer ran (in its order) that has evals."""
    ours = (result.get("ours") or {}).get("adapters", {})
    rows = []
    for name, peer in (result.get("peer") or {}).get("adapters", {}).items():
        final = final_point(peer["points"])
        if final is None:
            continue
        mine = ours.get(name)
        rows.append(
            Row(
                name=name,
                task=peer.get("task", name),
                peer_final=final,
                peer_s=float(peer["train_s"]),
                ours_final=final_point(mine["points"]) if mine else None,
                ours_reach=reach_point(mine["points"], final["acc"]) if mine else None,
            )
        )
    return rows


def totals(result: dict[str, Any], rows: list[Row]) -> Totals:
    ours = result.get("ours") or {}
    reach = [r.ours_reach_s for r in rows]
    return Totals(
        adapters=len(rows),
        ours_adapters=len(ours.get("adapters", {})),
        peer_s=sum(r.peer_s for r in rows),
        ours_reach_s=max(reach) if reach and all(t is not None for t in reach) else None,  # type: ignore[type-var]
        ours_run_s=ours.get("run_s"),
    )


def _acc(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    se = p.get("se")
    return f"{p['acc']:.3f} ± {se:.3f}" if se is not None else f"{p['acc']:.3f}"


def _s(t: float | None, missing: str = "not reached") -> str:
    return missing if t is None else f"{t:.1f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}x"


def markdown(result: dict[str, Any]) -> str:
    """The table (per adapter and the totals) and the lines that say what was measured where."""
    rows = table_rows(result)
    tot = totals(result, rows)
    s = result.get("settings", {})
    lines = [
        "| adapter | task | peer final held-out acc ± se (step) | peer s | ours final acc ± se (step) "
        "| ours s to reach the peer's final acc | peer s / ours s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours_final = f"{_acc(r.ours_final)} ({r.ours_final['step']})" if r.ours_final else "-"
        reach = (_s(r.ours_reach_s) + (" (step 0)" if r.at_start else "")) if r.ours_final else "-"
        lines.append(
            f"| {r.name} | {r.task} | {_acc(r.peer_final)} ({r.peer_final['step']}) | {r.peer_s:.1f} "
            f"| {ours_final} | {reach} | {'-' if r.at_start else _x(r.speedup)} |"
        )
    if rows:
        lines.append(
            f"| **all {tot.adapters}, one after another (peer) vs together (ours)** | | | **{tot.peer_s:.1f}** "
            f"| | **{_s(tot.ours_reach_s)}** | **{_x(tot.speedup_reach)}** |"
        )
    lines.append("")
    at_start = [r.name for r in rows if r.at_start]
    if at_start:
        lines.append(
            f"Reached at step 0 ({', '.join(at_start)}): the peer ended no better than ours' base model "
            "(the step-0 eval), so these rows' ratios say nothing (the totals count them at their step-0 time)."
        )
    if tot.ours_run_s is not None and rows:
        lines.append(
            f"Ours' whole run ({tot.ours_adapters} adapters together, each to its last step): "
            f"{tot.ours_run_s:.1f} s; the peer's {tot.adapters} one after another: {tot.peer_s:.1f} s "
            f"({_x(tot.peer_s / max(tot.ours_run_s, EPS))})"
            + (
                f"; the peer for all {tot.ours_adapters} at its mean per adapter: {tot.peer_all_s:.1f} s "
                f"({_x(tot.peer_all_s / max(tot.ours_run_s, EPS))})."
                if tot.ours_adapters > tot.adapters
                else "."
            )
        )
    lines += [
        "",
        "Seconds: wall-clock since training started, after the model load (ours: once, "
        f"{_s((result.get('ours') or {}).get('load_s'), '-')} s; the peer: a fresh base model per "
        "adapter, its load not counted either), held-out eval time left out, the same clock for both. "
        "The peer's total is the sum of its adapters' times (one after another). Held-out accuracy: "
        "greedy, the same items and the same scoring for both, mean over the items ± its standard error.",
        f"Card: {result.get('device', '?')}. The peer: TRL {s.get('trl', '?')} GRPOTrainer + PEFT LoRA, "
        "generating with transformers (`use_vllm=False`: vLLM cannot be installed on that machine); ours: "
        f"{s.get('ours_engine', 'the embedded engine')}.",
    ]
    if s.get("differences"):
        lines.append("Known differences: " + "; ".join(s["differences"]) + ".")
    for command in result.get("commands", []):
        lines.append(f"Command: `{command}`")
    return "\n".join(lines) + "\n"


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One result from two partial runs on the same card: ours from whichever has it, the peer's
    adapters from both. Raises ValueError (naming what differs) for two cards, ours twice, an
    adapter the peer ran twice, or an adapter's settings that differ."""
    if a.get("device") != b.get("device"):
        raise ValueError(f"the runs are on different cards: {a.get('device')!r} vs {b.get('device')!r}")
    if a.get("ours") and b.get("ours"):
        raise ValueError(
            "both runs hold ours: merge a run of ours (--skip-peer) with peer runs (--skip-ours)"
        )
    out = copy.deepcopy(a)
    out["ours"] = copy.deepcopy(a.get("ours") or b.get("ours"))
    specs_a, specs_b = a.get("settings", {}).get("specs", {}), b.get("settings", {}).get("specs", {})
    for name in set(specs_a) & set(specs_b):
        if specs_a[name] != specs_b[name]:
            raise ValueError(f"adapter {name!r} ran with different settings in the two runs")
    peer = copy.deepcopy((a.get("peer") or {}).get("adapters", {}))
    for name, curve in ((b.get("peer") or {}).get("adapters", {})).items():
        if name in peer:
            raise ValueError(f"the peer ran adapter {name!r} in both runs")
        peer[name] = copy.deepcopy(curve)
    order = list(specs_a) + [n for n in specs_b if n not in specs_a]  # the adapters' order of the runs
    out["peer"] = {"adapters": {n: peer[n] for n in sorted(peer, key=lambda n: _index(order, n))}}
    out.setdefault("settings", {})["specs"] = {**specs_b, **specs_a}
    out["commands"] = [*a.get("commands", []), *b.get("commands", [])]
    return out


def _index(order: list[str], name: str) -> int:
    return order.index(name) if name in order else len(order)


def mean_curve(
    curves: dict[str, list[dict[str, Any]]], offsets: dict[str, float]
) -> list[tuple[float, float]]:
    """Mean accuracy over the adapters against time: each adapter holds its latest eval (its first
    one before that, ``offsets``: when its clock starts on the common one)."""
    events = sorted((offsets.get(n, 0.0) + p["t"], n, p["acc"]) for n, pts in curves.items() for p in pts)
    if not curves or not events:
        return []
    current = {n: min(pts, key=lambda p: p["step"])["acc"] for n, pts in curves.items() if pts}
    out = []
    for t, name, acc in events:
        current[name] = acc
        out.append((t, sum(current.values()) / len(current)))
    return out


def plot(result: dict[str, Any], png: str | Path) -> Path | None:
    """Held-out accuracy against wall-clock: a panel per adapter (ours and the peer), and an
    aggregate panel: the mean over the peer's adapters, ours together vs the peer one after another."""
    ours = (result.get("ours") or {}).get("adapters", {})
    peer = (result.get("peer") or {}).get("adapters", {})
    names = list(dict.fromkeys([*peer, *ours]))
    if not names:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(names) + 1
    cols = min(4, panels)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax, name in zip(flat, names, strict=False):
        for label, curves, style in (("ours", ours, "C0-o"), ("peer (TRL)", peer, "C1-s")):
            pts = sorted(curves.get(name, {}).get("points", []), key=lambda p: p["step"])
            if pts:
                ax.errorbar(
                    [p["t"] for p in pts], [p["acc"] for p in pts], yerr=[p.get("se") or 0 for p in pts],
                    fmt=style, ms=3, capsize=2, label=label,
                )  # fmt: skip
        ax.set_title(name, fontsize="small")
        ax.set_xlabel("seconds")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize="x-small")
    ax = flat[len(names)]
    keep = list(peer) or list(ours)
    mine = {n: ours[n]["points"] for n in keep if n in ours}
    if mine:
        curve = mean_curve(mine, {})
        ax.step([t for t, _ in curve], [m for _, m in curve], "C0-", where="post", label="ours, together")
    theirs = {n: peer[n]["points"] for n in keep if n in peer}
    if theirs:
        offsets, clock = {}, 0.0
        for n in theirs:
            offsets[n] = clock
            clock += float(peer[n]["train_s"])
        curve = mean_curve(theirs, offsets)
        ax.step(
            [t for t, _ in curve], [m for _, m in curve], "C1-", where="post", label="peer, one after another"
        )
    ax.set_title(f"mean over {len(keep)} adapters", fontsize="small")
    ax.set_xlabel("seconds")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize="x-small")
    for extra in flat[len(names) + 1 :]:
        extra.axis("off")
    fig.suptitle(f"held-out accuracy against wall-clock ({result.get('device', '?')})", fontsize="small")
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
