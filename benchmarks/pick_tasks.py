"""Pick the adapter specs a model learns most, from a short run of ours (``vs_trl.py --skip-peer``).

Reads the run's ``vs_trl.json``, ranks its adapters by held-out gain (final accuracy minus the
step-0 accuracy, ties to the higher final accuracy), prints the ranking and copies the specs of the
best ``--top`` from ``--specs`` into ``--dest``. ``--replicas R`` writes each picked spec R times
(``<name>_r<k>``, its dataset and run seeds moved by ``k``), for runs of many adapters on few tasks.

    python benchmarks/vs_trl.py --adapters benchmarks/task_candidates --skip-peer --steps 20 --out runs/screen
    python benchmarks/pick_tasks.py runs/screen/vs_trl.json --specs benchmarks/task_candidates \\
        --top 16 --dest examples/multi_lora/gpu_adapters
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def gains(result: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(name, step-0 accuracy, final accuracy, gain) of each adapter of ours, best first."""
    rows = []
    for name, curve in result["ours"]["adapters"].items():
        points = sorted(curve["points"], key=lambda p: p["step"])
        if not points:
            continue
        first, last = points[0]["acc"], points[-1]["acc"]
        rows.append((name, first, last, last - first))
    return sorted(rows, key=lambda r: (-r[3], -r[2], r[0]))


def replica(spec: dict[str, Any], k: int) -> dict[str, Any]:
    """Spec ``k`` of a replicated task: its own name, dataset draw and run seed."""
    out = json.loads(json.dumps(spec))
    out["name"] = f"{spec['name']}_r{k}"
    out["dataset"]["seed"] = int(spec["dataset"].get("seed", 0)) + 1000 * k
    out["seed"] = int(spec.get("seed", 0)) + k
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", type=Path, help="vs_trl.json of a run of ours")
    parser.add_argument("--specs", type=Path, required=True, help="the folder of the run's spec YAMLs")
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    ranked = gains(json.loads(args.result.read_text()))
    by_name = {yaml.safe_load(f.read_text())["name"]: f for f in sorted(args.specs.glob("*.yaml"))}
    print("| rank | adapter | step 0 | final | gain |\n|---|---|---|---|---|")
    for i, (name, first, last, gain) in enumerate(ranked, 1):
        print(f"| {i}{' *' if i <= args.top else ''} | {name} | {first:.3f} | {last:.3f} | {gain:+.3f} |")
    args.dest.mkdir(parents=True, exist_ok=True)
    for name, *_ in ranked[: args.top]:
        spec = yaml.safe_load(by_name[name].read_text())
        for k in range(args.replicas):
            out = spec if args.replicas == 1 else replica(spec, k)
            (args.dest / f"{out['name']}.yaml").write_text(yaml.safe_dump(out, sort_keys=False))
    print(f"{min(args.top, len(ranked)) * args.replicas} specs -> {args.dest}")


if __name__ == "__main__":
    main()
