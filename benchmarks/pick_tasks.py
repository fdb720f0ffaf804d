"""Pick the adapter specs a model learns most, from a short run of ours (``vs_trl.py --skip-peer``).

Reads the run's ``vs_trl.json``, ranks its adapters by held-out gain (final accuracy minus the
step-0 accuracy, ties to the higher final accuracy), prints the ranking and copies the specs of the
best ``--top`` from ``--specs`` into ``--dest``. ``--replicas R`` writes each picked spec R times
(``<name>_r<k>``, its dataset and run seeds moved by ``k``), for runs of many adapters on few tasks.
``--min-gain-se K`` keeps only adapters whose gain exceeds K combined standard errors of the two
accuracies (``z`` = gain / sqrt(se0^2 + se1^2), from the eval points' ``se``): a task that moved by
chance in a short run is not picked.

    python benchmarks/vs_trl.py --adapters benchmarks/task_candidates --skip-peer --steps 20 --out runs/screen
    python benchmarks/pick_tasks.py runs/screen/vs_trl.json --specs benchmarks/task_candidates \\
        --top 16 --dest examples/multi_lora/gpu_adapters
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import yaml


class Gain(NamedTuple):
    """One adapter's held-out accuracy at its first and last eval, and the gain in standard errors."""

    name: str
    first: float
    last: float
    gain: float
    z: float | None  # gain / sqrt(se_first^2 + se_last^2); None without ``se`` (inf when both are 0)


def gain_z(gain: float, se_first: float | None, se_last: float | None) -> float | None:
    """``gain`` in combined standard errors of the two accuracies (``None`` when one is unknown)."""
    if se_first is None or se_last is None:
        return None
    combined = math.hypot(se_first, se_last)
    if combined == 0:
        return math.inf if gain > 0 else (-math.inf if gain < 0 else 0.0)
    return gain / combined


def gains(result: dict[str, Any]) -> list[Gain]:
    """The gain of each adapter of ours, best first (ties to the higher final accuracy)."""
    rows = []
    for name, curve in result["ours"]["adapters"].items():
        points = sorted(curve["points"], key=lambda p: p["step"])
        if not points:
            continue
        first, last = points[0], points[-1]
        gain = last["acc"] - first["acc"]
        rows.append(
            Gain(name, first["acc"], last["acc"], gain, gain_z(gain, first.get("se"), last.get("se")))
        )
    return sorted(rows, key=lambda r: (-r.gain, -r.last, r.name))


def significant(ranked: list[Gain], min_gain_se: float) -> list[Gain]:
    """The adapters whose gain exceeds ``min_gain_se`` combined standard errors, in rank order."""
    unknown = [r.name for r in ranked if r.z is None]
    if unknown:
        raise SystemExit(
            f"--min-gain-se: no 'se' on the eval points of {', '.join(unknown)}; rerun vs_trl.py (it records "
            "eval/accuracy_se) or leave --min-gain-se out"
        )
    return [r for r in ranked if r.z > min_gain_se]


def replica(spec: dict[str, Any], k: int) -> dict[str, Any]:
    """Spec ``k`` of a replicated task: its own name, dataset draw and run seed."""
    out = json.loads(json.dumps(spec))
    out["name"] = f"{spec['name']}_r{k}"
    out["dataset"]["seed"] = int(spec["dataset"].get("seed", 0)) + 1000 * k
    out["seed"] = int(spec.get("seed", 0)) + k
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", type=Path, help="vs_trl.json of a run of ours")
    parser.add_argument("--specs", type=Path, required=True, help="the folder of the run's spec YAMLs")
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--min-gain-se",
        type=float,
        default=None,
        metavar="K",
        help="pick only adapters whose gain exceeds K combined standard errors (default: no bound)",
    )
    args = parser.parse_args(argv)
    ranked = gains(json.loads(args.result.read_text()))
    eligible = ranked if args.min_gain_se is None else significant(ranked, args.min_gain_se)
    picked = {r.name for r in eligible[: args.top]}
    by_name = {yaml.safe_load(f.read_text())["name"]: f for f in sorted(args.specs.glob("*.yaml"))}
    print("| rank | adapter | step 0 | final | gain | gain / se |\n|---|---|---|---|---|---|")
    for i, r in enumerate(ranked, 1):
        z = "" if r.z is None else f"{r.z:.1f}"
        mark = " *" if r.name in picked else ""
        print(f"| {i}{mark} | {r.name} | {r.first:.3f} | {r.last:.3f} | {r.gain:+.3f} | {z} |")
    args.dest.mkdir(parents=True, exist_ok=True)
    for r in eligible[: args.top]:
        spec = yaml.safe_load(by_name[r.name].read_text())
        for k in range(args.replicas):
            out = spec if args.replicas == 1 else replica(spec, k)
            (args.dest / f"{out['name']}.yaml").write_text(yaml.safe_dump(out, sort_keys=False))
    print(f"{len(picked) * args.replicas} specs -> {args.dest}")


if __name__ == "__main__":
    main()
